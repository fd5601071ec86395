"""Beam search as transformers' `generate(num_beams=k)` does it, over any source of next-token logprobs.

The search is pure bookkeeping: each step it takes, for every running beam, the top 2k (token, logprob) pairs of
the next position and keeps the k best continuations by summed logprob. The engine needs nothing new: each beam
is one ordinary request of one token with logprobs, and the beams of a prompt share their history's KV blocks
through the prefix cache (a beam recomputes only its last, partial block: the copy of copy-on-write).

The rules are transformers' (5.x, `early_stopping=False`), so greedy beams match it token for token:
- candidates are the top 2k of all beams' continuations; those that end (an EOS, or the length limit) among the
  first k of them become finished hypotheses, scored `cum_logprob / generated_len ** length_penalty`, and the
  best k hypotheses are kept;
- the best k candidates that did not end are the next beams;
- the search stops when every candidate ends, or when k hypotheses are finished and the best running beam,
  scored at its current length, cannot beat the worst of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

TopLogprobs = list[tuple[int, float]]   # a beam's next-token candidates: (token id, logprob), best first


@dataclass
class BeamSearchParams:
    """vLLM's names. `beam_width` beams are kept and that many sequences returned, best first."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (it is deterministic), got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One returned beam. `tokens` holds the prompt and the generated ids (vLLM's layout), `text` the generated
    part decoded; `score` is the length-penalised score the beams are ranked by."""
    tokens: list[int]
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    text: str | None = None
    finish_reason: str | None = None   # "stop" (an EOS) or "length"
    stop_reason: int | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    generated: list[int]
    cum_logprob: float


class BeamSearch:
    """The state of one prompt's search. `pending()` are the token lists to score next; `advance()` takes their
    top candidates, in the same order."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_total_tokens: int):
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_new = min(params.max_tokens, max_total_tokens - len(self.prompt))
        if self.max_new < 1:
            raise ValueError(f"the prompt ({len(self.prompt)} tokens) leaves no room under max_model_len "
                             f"{max_total_tokens}")
        self.running = [_Beam([], 0.0)]
        self.finished: list[tuple[float, _Beam, bool]] = []   # (score, beam, ended on an EOS), best first
        self.improvable = True
        self.done = False

    @property
    def num_candidates(self) -> int:
        return 2 * self.params.beam_width

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + b.generated for b in self.running]

    def advance(self, tops: Sequence[TopLogprobs]) -> None:
        k, lp = self.params.beam_width, self.params.length_penalty
        gen_len = len(self.running[0].generated) + 1
        cands = sorted(((beam.cum_logprob + logprob, b, tok) for b, beam in enumerate(self.running)
                        for tok, logprob in tops[b]), key=lambda c: (-c[0], c[1], c[2]))[:self.num_candidates]
        ends = [tok in self.eos or gen_len >= self.max_new for _, _, tok in cands]
        if self.improvable:
            new = [(cum / gen_len ** lp, _Beam(self.running[b].generated + [tok], cum), tok in self.eos)
                   for (cum, b, tok), end in zip(cands[:k], ends[:k]) if end]
            self.finished = sorted(self.finished + new, key=lambda f: -f[0])[:k]
        self.running = [_Beam(self.running[b].generated + [tok], cum)
                        for (cum, b, tok), end in zip(cands, ends) if not end][:k]
        if self.improvable and self.running and len(self.finished) == k:
            self.improvable = self.running[0].cum_logprob / gen_len ** lp > self.finished[-1][0]
        self.done = not self.improvable or not self.running

    def result(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        out = BeamSearchOutput()
        for score, beam, on_eos in self.finished:
            text_ids = beam.generated[:-1] if on_eos and not self.params.include_stop_str_in_output else beam.generated
            out.sequences.append(BeamSearchSequence(
                self.prompt + beam.generated, beam.cum_logprob, score, len(self.prompt),
                decode(text_ids) if decode is not None else None,
                "stop" if on_eos else "length", beam.generated[-1] if on_eos else None))
        return out


def top_of(logprobs: dict, n: int) -> TopLogprobs:
    """The n best (token, logprob) of one position's vLLM-shaped logprobs ({token: Logprob}; the sampled token is
    among them)."""
    return sorted(((tok, lp.logprob) for tok, lp in logprobs.items()), key=lambda t: -t[1])[:n]


Scorer = Callable[[list[list[int]], list[int]], list[TopLogprobs]]


def _pending(searches: list[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]], list[int], list[int]]:
    """The searches still going, all their beams' token lists, each list's candidate count, and how many lists
    each search has."""
    live = [s for s in searches if not s.done]
    lists, counts, sizes = [], [], []
    for s in live:
        pending = s.pending()
        lists += pending
        counts += [s.num_candidates] * len(pending)
        sizes.append(len(pending))
    return live, lists, counts, sizes


def _advance(live: list[BeamSearch], sizes: list[int], tops: list[TopLogprobs]) -> None:
    start = 0
    for s, n in zip(live, sizes):
        s.advance(tops[start:start + n])
        start += n


def run_beam_search(searches: list[BeamSearch], score: Scorer) -> None:
    """Steps every search until all are done. `score(token_lists, num_candidates)` returns each list's top
    candidates for its next token; one call a step serves every running beam of every prompt (one batch)."""
    while True:
        live, lists, counts, sizes = _pending(searches)
        if not live:
            return
        _advance(live, sizes, score(lists, counts))


async def run_beam_search_async(searches: list[BeamSearch],
                                score: Callable[[list[list[int]], list[int]], Awaitable[list[TopLogprobs]]]) -> None:
    """run_beam_search for the server, whose scorer awaits the engine."""
    while True:
        live, lists, counts, sizes = _pending(searches)
        if not live:
            return
        _advance(live, sizes, await score(lists, counts))
