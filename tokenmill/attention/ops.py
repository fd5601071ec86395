"""Cache writes shared by every backend."""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their slots of the paged cache [2, N, block_size, Hkv, D]."""
    _, _, _, hkv, d = kv_cache.shape
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
