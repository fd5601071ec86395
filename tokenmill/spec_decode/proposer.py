"""The proposer seam: after a step samples, propose the next drafts of each request that sampled.

A proposer sees the model runner's per-request state (its tokens, its block table) and returns
`{request_id: draft token ids}`; the scheduler hands them back as extra tokens of the next step, and the
rejection sampler decides what stays. Proposers only make steps cheaper, never change their result.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.worker.input_batch import CachedRequestState


class Proposer(Protocol):
    observes: bool   # wants observe() every step (EAGLE); the others are not called for it

    def observe(self, states: list[CachedRequestState], qsl: np.ndarray, seq_lens: np.ndarray,
                hidden: torch.Tensor) -> None:
        """Every step, after verification: the target's hidden states of the step's tokens (EAGLE reads them)."""

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]: ...

    def forget(self, req_ids: set[str]) -> None:
        """Requests that finished, were preempted or start over: drop what is kept about them."""

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...


class NoObservation:
    """A proposer that never reads the target's hidden states."""

    observes = False

    def observe(self, states, qsl, seq_lens, hidden) -> None:
        pass


class NgramProposer(NoObservation):
    """Prompt lookup: find the request's last n tokens earlier in its own tokens (n from prompt_lookup_max down
    to prompt_lookup_min, the latest occurrence) and propose what followed them there. No model."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        out = {}
        for s in states:
            drafts = ngram_lookup(s.token_ids, self.min_n, self.max_n, self.k)
            if drafts:
                out[s.req_id] = drafts
        return out

    def forget(self, req_ids: set[str]) -> None:
        pass

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of length
    min_n..max_n; [] when there is none."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # windows start at 0..num-1-n: never the suffix itself, and at least one token follows each
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[num - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []
