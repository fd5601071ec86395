"""Full (bidirectional) self-attention over an encoder's positions, batched: the vision towers' and Whisper's
audio encoder's (Whisper's key projection has no bias). Plain torch: an encoder runs once per image or window."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EncoderSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, key_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=key_bias)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))
