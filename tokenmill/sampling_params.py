"""SamplingParams with vLLM's names and semantics; every invalid field raises a ValueError naming it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from tokenmill.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
POOLING_TYPES = ("last", "mean", "cls")


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0   # every output carries all text so far
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # one output when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: StructuredOutputsParams | None = None   # a grammar the output must follow
    # An embedding request (set by embed() and /v1/embeddings, not by users): the prompt's final hidden states
    # pooled this way ("last", "mean" or "cls", see POOLING_TYPES), L2-normalised if normalize; one token is run.
    pooling: str | None = None
    normalize: bool = True
    # Filled by the engine: the EOS ids of the model (unless ignore_eos) and stop_token_ids together.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias keys must be token ids and values numbers: {e}") from e
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        need(isinstance(self.n, int) and self.n >= 1, "n", "at least 1")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "greater than zero")
        need(self.temperature >= 0.0, "temperature", "non-negative")
        need(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1 or 0 (disabled) or at least 1")
        need(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        need(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64), "seed",
             "an integer in [-2**63, 2**64)")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "at least 1")
        need(self.pooling is None or self.pooling in POOLING_TYPES, "pooling", f"one of {', '.join(POOLING_TYPES)}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs",
             "a non-negative integer")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
             "prompt_logprobs", "a non-negative integer")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def update_from_model(self, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        """Resolve what depends on the model: the full stop-id set, and token ids that must exist."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {}))):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token id(s) {bad[:5]} outside the vocabulary of {vocab_size}")
        self.all_stop_token_ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            self.all_stop_token_ids.update(eos_token_ids)

    def clone(self, **changes) -> SamplingParams:
        import dataclasses

        return dataclasses.replace(self, **changes)
