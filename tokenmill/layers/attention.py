"""The attention layer: writes this step's K/V into its paged cache, then asks the backend to attend."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import write_kv


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner: [2, N, block_size, Hkv, D]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """kv_written: the caller already stored this step's K/V (the fused rope-and-cache kernel)."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache was not bound to this attention layer")
        if not kv_written:
            write_kv(self.kv_cache, k, v, md.slot_mapping)
        return self.backend.forward(q, k, v, self.kv_cache, md, self.scale)
