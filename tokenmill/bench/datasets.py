"""Benchmark prompts: random token ids from a seed, the same way the peer scripts make them, so every
engine sees exactly the same input tokens (ids below 17 are SmolLM2's special tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_NORMAL_ID = 17

# The standard workloads of shared/workloads.md: requests, input (suffix) length, output length, shared prefix.
WORKLOADS = {
    "W1": dict(num_prompts=128, input_len=256, output_len=128, prefix_len=0, dataset_seed=1),
    "W2": dict(num_prompts=1, input_len=128, output_len=256, prefix_len=0, dataset_seed=2),
    "W3": dict(num_prompts=64, input_len=32, output_len=64, prefix_len=1024, dataset_seed=3),
    "W4": dict(num_prompts=64, input_len=256, output_len=128, prefix_len=0, dataset_seed=0),
    # W5: how many requests a fixed 256 MiB KV cache holds at once, prompts of 64..1,024 tokens
    "W5": dict(num_prompts=128, input_len=1024, min_input_len=64, output_len=128, prefix_len=0, dataset_seed=5,
               kv_cache_memory="256MiB"),
    # W8: long contexts, 4 prompts of 7,936 tokens at once (W8-1: one alone), 8,064 of the model's 8,192
    "W8": dict(num_prompts=4, input_len=7936, output_len=128, prefix_len=0, dataset_seed=8),
    "W8-1": dict(num_prompts=1, input_len=7936, output_len=128, prefix_len=0, dataset_seed=9),
}


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, prefix_len: int = 0, seed: int = 0,
                    vocab_size: int = 49152, min_input_len: int | None = None,
                    num_prefixes: int = 1) -> list[BenchRequest]:
    """A shared prefix (if any) then a distinct random body per request, drawn with numpy's PCG64; with
    min_input_len, each body is cut to a length drawn uniformly from min_input_len..input_len. With
    num_prefixes > 1, request i gets prefix i % num_prefixes (many system prompts: what a router spreads)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(FIRST_NORMAL_ID, vocab_size, size=(prefix_len,), dtype=np.int64).tolist()
                if prefix_len else [] for _ in range(max(1, num_prefixes))]
    body = rng.integers(FIRST_NORMAL_ID, vocab_size, size=(num_prompts, input_len), dtype=np.int64).tolist()
    if min_input_len is not None:
        lengths = rng.integers(min_input_len, input_len + 1, size=num_prompts)
        body = [b[:n] for b, n in zip(body, lengths)]
    return [BenchRequest(prefixes[i % len(prefixes)] + b, output_len) for i, b in enumerate(body)]


def apply_workload(ns) -> None:
    """Fill --num-prompts/--input-len/--output-len/--prefix-len/--dataset-seed from --workload where not given."""
    if getattr(ns, "workload", None):
        for key, value in WORKLOADS[ns.workload].items():
            if getattr(ns, key, None) is None:
                setattr(ns, key, value)
    defaults = dict(num_prompts=100, input_len=256, output_len=128, prefix_len=0, dataset_seed=0, min_input_len=None)
    for key, value in defaults.items():
        if getattr(ns, key, None) is None:
            setattr(ns, key, value)
