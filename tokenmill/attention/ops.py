"""Cache writes shared by every backend, and the quantized KV-cache dtypes (fp8 e4m3/e5m2, int8) with one
scale per tensor: stored = value / scale, saturated to the dtype's range; read back as stored * scale.

K may also be stored less a per-channel offset ([Hkv, D], the mean K of calibration text): stored =
(K - offset) / scale, and every reader attends the stored keys as they are, without adding it back. That is
exact: shifting all keys by one vector adds q . offset to every score of a query row, which the softmax removes,
and every softmax over cached keys reads only cached keys (a fresh prompt attends only its fresh K, never mixed
with the cache). It makes the quantization error smaller where a channel's keys sit far from zero (SmolLM2's
K has channels whose values stay near 10-20 for every token: there fp8's steps are 1-2)."""

from __future__ import annotations

import torch

from tokenmill.config import KV_CACHE_DTYPES as CONFIG_KV_NAMES

# The quantized --kv-cache-dtype names (config.KV_CACHE_DTYPES but "auto", which keeps the model dtype) ->
# (storage dtype, largest stored magnitude).
KV_CACHE_DTYPES = {
    "fp8": (torch.float8_e4m3fn, 448.0),        # vLLM's meaning of fp8
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int8": (torch.int8, 127.0),
}
assert set(KV_CACHE_DTYPES) == set(CONFIG_KV_NAMES) - {"auto"}, "config.KV_CACHE_DTYPES and this map disagree"
_RANGE = {dtype: limit for dtype, limit in KV_CACHE_DTYPES.values()}


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name][0]


def is_quantized_kv(cache: torch.Tensor) -> bool:
    return cache.dtype in _RANGE


def kv_range(dtype: torch.dtype) -> float:
    return _RANGE[dtype]


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = kv_range(dtype)
    y = (x.float() * (1.0 / scale)).clamp_(-limit, limit)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V back in `dtype` (a view of the same tensor when the cache is not quantized)."""
    if not is_quantized_kv(x):
        return x
    return (x.float() * scale).to(dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, k_offset: torch.Tensor | None = None) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their slots of the paged cache [2, N, block_size, Hkv, D]
    (a quantized cache stores K less k_offset, when given: see above)."""
    _, _, _, hkv, d = kv_cache.shape
    if is_quantized_kv(kv_cache):  # (index_copy_ has no fp8 kernel: the bytes are copied as uint8)
        if k_offset is not None:
            k = k.float() - k_offset
        k = quantize_kv(k, k_scale, kv_cache.dtype).view(torch.uint8)
        v = quantize_kv(v, v_scale, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
