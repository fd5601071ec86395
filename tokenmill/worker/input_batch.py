"""Per-request state the model runner keeps between steps, so the scheduler only sends diffs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    token_buf: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_tokens: int = 0
    prompt_logprobs_sent: bool = False
    pool_acc: torch.Tensor | None = None   # an embedding request's pooled hidden state so far (sum, or first row)
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] | None = None   # a vision model's images of this request
    mrope: tuple | None = None   # M-RoPE models: the prompt's [3, n] positions and delta (multimodal/mrope.py)

    @classmethod
    def create(cls, req_id: str, token_ids: list[int], num_prompt_tokens: int, sp: SamplingParams,
               block_ids: list[int], num_computed_tokens: int, generator: torch.Generator | None):
        state = cls(req_id, num_prompt_tokens, sp, list(block_ids), num_computed_tokens, generator)
        state.token_buf = np.zeros(max(16, 2 * len(token_ids)), dtype=np.int64)
        state.token_buf[: len(token_ids)] = token_ids
        state.num_tokens = len(token_ids)
        return state

    def append_token(self, token_id: int) -> None:
        self._reserve(self.num_tokens + 1)
        self.token_buf[self.num_tokens] = token_id
        self.num_tokens += 1

    def write_drafts(self, draft_ids: list[int]) -> None:
        """Drafts go right after the known tokens, so a step's inputs are one slice of the buffer; they count
        as tokens only once verified (append_token overwrites them)."""
        self._reserve(self.num_tokens + len(draft_ids))
        self.token_buf[self.num_tokens: self.num_tokens + len(draft_ids)] = draft_ids

    def _reserve(self, n: int) -> None:
        while n > len(self.token_buf):
            self.token_buf = np.concatenate([self.token_buf, np.zeros_like(self.token_buf)])

    @property
    def token_ids(self) -> np.ndarray:
        return self.token_buf[: self.num_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_buf[self.num_prompt_tokens: self.num_tokens].tolist()
