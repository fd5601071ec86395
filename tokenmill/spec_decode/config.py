"""`--speculative-config` (vLLM's JSON keys) -> a frozen SpeculativeConfig, with errors that name the field.

Imports no torch: the scheduler reads `num_lookahead_tokens` from plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.utils import json_object

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM's keys that tokenmill reads; any other key is an error rather than silently ignored
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
         "quantization_group_size", "disable_by_batch_size"}
# At four speculative tokens a step of a few requests verifies ~20 tokens, where this CPU's matmuls stop
# being bound by reading the weights: past this many running requests speculation costs more than it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None                 # the draft (draft_model: None means the target's own weights)
    quantization: str | None = None          # the draft's weights (the self-draft: int4 or gguf)
    quantization_group_size: int = 32
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def uses_model(self) -> bool:
        return self.method != "ngram"

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens a proposer model writes while drafting (its own cache, the same
        block table)."""
        return self.num_speculative_tokens if self.uses_model else 0

    def describe(self) -> str:
        what = {"ngram": f"ngram (prompt lookup {self.prompt_lookup_min}..{self.prompt_lookup_max})",
                "draft_model": f"draft model {self.model or 'the target itself'}"
                               + (f" with {self.quantization} weights" if self.quantization else "")}.get(
            self.method, f"{self.method} head {self.model}")
        off = (f", off above {self.disable_by_batch_size} running requests"
               if self.disable_by_batch_size is not None else "")
        return f"{what}, {self.num_speculative_tokens} tokens a step{off}"


def parse_speculative_config(raw: str | dict | None) -> SpeculativeConfig | None:
    if raw is None or raw == "" or raw == {}:
        return None
    raw = json_object(raw, "speculative_config")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_KEYS))}")
    method = _method(raw)
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer of at least 1, got {k!r}")
    fields: dict[str, Any] = dict(method=method, num_speculative_tokens=k)
    if method == "ngram":
        fields.update(_lookup_range(raw))
    else:
        fields.update(model=raw.get("model"), quantization=raw.get("quantization"))
        if method != "draft_model" and not fields["model"]:
            raise ValueError(f"speculative_config.model is required for method {method!r} (the head's folder)")
        if "quantization_group_size" in raw:
            fields["quantization_group_size"] = _int(raw, "quantization_group_size", 1)
    if "disable_by_batch_size" in raw:
        v = raw["disable_by_batch_size"]
        fields["disable_by_batch_size"] = None if v is None else _int(raw, "disable_by_batch_size", 1)
    return SpeculativeConfig(**fields)


def check_against_max_model_len(spec: SpeculativeConfig, max_model_len: int) -> None:
    if spec.num_speculative_tokens >= max_model_len:
        raise ValueError(f"speculative_config.num_speculative_tokens ({spec.num_speculative_tokens}) must be smaller "
                         f"than max_model_len ({max_model_len})")


def _method(raw: dict) -> str:
    method = raw.get("method")
    if method is None:  # vLLM infers it from the other keys
        model = str(raw.get("model") or "")
        if model in ("ngram", "[ngram]"):
            method = "ngram"
        elif "eagle3" in model.lower():
            method = "eagle3"
        elif "eagle" in model.lower():
            method = "eagle"
        elif model or raw.get("quantization"):
            method = "draft_model"
        else:
            raise ValueError(f"speculative_config.method is required: one of {', '.join(SPEC_METHODS)}")
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config.method {method!r} is not supported; choose one of "
                         f"{', '.join(SPEC_METHODS)}")
    return method


def _lookup_range(raw: dict) -> dict[str, int]:
    lo = _int(raw, "prompt_lookup_min", 1) if raw.get("prompt_lookup_min") is not None else None
    hi = _int(raw, "prompt_lookup_max", 1) if raw.get("prompt_lookup_max") is not None else None
    if lo is None and hi is None:
        lo = hi = 5  # vLLM's defaults
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be at most prompt_lookup_max ({hi})")
    return dict(prompt_lookup_min=lo, prompt_lookup_max=hi)


def _int(raw: dict, key: str, minimum: int) -> int:
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"speculative_config.{key} must be an integer of at least {minimum}, got {v!r}")
    return v
