"""The attention layer: writes this step's K/V into its paged cache, then asks the backend to attend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import is_quantized_kv, kv_range, write_kv

# Calibrated scales leave this much room above the largest value seen in the calibration step.
KV_SCALE_HEADROOM = 1.25
# Calibration reads the K/V of every step until one writes a single token (the warm-up's first decode step) or it
# has seen this many; the first calibrated tokens are left out of the K offset: a sequence's first keys are
# attention sinks, unlike the rest.
KV_CALIBRATION_MAX_TOKENS = 2048
KV_OFFSET_SKIP_TOKENS = 4


@dataclass
class KVCalibration:
    """What calibration has seen so far: K's sum (for the offset), K's per-channel extremes and V's largest
    magnitude (for the scales)."""

    k_sum: torch.Tensor
    k_max: torch.Tensor
    k_min: torch.Tensor
    v_absmax: float = 0.0
    count: int = 0
    seen: int = 0

    @classmethod
    def empty(cls, hkv: int, d: int, device: torch.device) -> KVCalibration:
        return cls(torch.zeros(hkv, d, device=device), torch.full((hkv, d), -torch.inf, device=device),
                   torch.full((hkv, d), torch.inf, device=device))

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        k = k.float()
        skip = max(0, KV_OFFSET_SKIP_TOKENS - self.seen)
        self.k_sum += k[skip:].sum(0)
        self.count += max(0, k.shape[0] - skip)
        self.seen += k.shape[0]
        self.k_max = torch.maximum(self.k_max, k.amax(0))
        self.k_min = torch.minimum(self.k_min, k.amin(0))
        self.v_absmax = max(self.v_absmax, float(v.abs().max()))


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 sliding_window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window  # 0: full attention
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner: [2, N, block_size, Hkv, D]
        # a quantized cache stores (K - k_offset) / k_scale and V / v_scale (attention/ops.py); with calibrate set,
        # the first steps that write K/V (the engine's warm-up, on real text: see KVCalibration) set k_offset to
        # their mean K, and with calibrate_scales too both scales from their largest values (--calculate-kv-scales,
        # and always for int8)
        self.k_scale = self.v_scale = 1.0
        self.k_offset: torch.Tensor | None = None   # [Hkv, D] fp32
        self.calibrate = self.calibrate_scales = False
        self._calibration: KVCalibration | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """kv_written: the caller already stored this step's K/V (the fused rope-and-cache kernel)."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache was not bound to this attention layer")
        if self.calibrate:
            self._calibrate(k, v)
        if not kv_written:
            write_kv(self.kv_cache, k, v, md.slot_mapping, self.k_scale, self.v_scale, self.k_offset)
        return self.backend.forward(q, k, v, self.kv_cache, md, self.scale, k_scale=self.k_scale,
                                    v_scale=self.v_scale, window=self.sliding_window)

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds this step's K/V to the calibration; at its end (see KV_CALIBRATION_MAX_TOKENS) sets the offset
        and the scales, which this step's write already uses."""
        cal = self._calibration
        if cal is None:
            cal = self._calibration = KVCalibration.empty(self.num_kv_heads, self.head_dim, k.device)
        cal.add(k, v)
        if k.shape[0] > 1 and cal.seen < KV_CALIBRATION_MAX_TOKENS:
            return
        quantized = is_quantized_kv(self.kv_cache)
        offset = torch.zeros_like(cal.k_sum)
        if quantized and cal.count:
            offset = self.k_offset = (cal.k_sum / cal.count).contiguous()
        if self.calibrate_scales:
            limit = kv_range(self.kv_cache.dtype) if quantized else 1.0
            k_absmax = float(torch.maximum(cal.k_max - offset, offset - cal.k_min).max())
            self.k_scale = max(k_absmax * KV_SCALE_HEADROOM / limit, 1e-6)
            self.v_scale = max(cal.v_absmax * KV_SCALE_HEADROOM / limit, 1e-6)
        self.calibrate, self._calibration = False, None


def allocate_kv_caches(layers: list[PagedAttention], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: str, what: str) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] cache per attention layer, bound to it, and a log line. A
    draft model or EAGLE head gets its own caches of the target's blocks this way, read through the same block
    tables. On the CPU they live in one anonymous memory map: zero by definition and touched only as blocks fill,
    where torch.zeros writes every page first (2.3 s for 4 GiB at start)."""
    import time

    from tokenmill.utils import format_bytes, init_logger

    t0 = time.perf_counter()
    shapes = [(2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim) for layer in layers]
    if torch.device(device).type == "cpu":
        caches = _zero_mapped(shapes, dtype)
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache
    total = sum(t.numel() * t.element_size() for t in caches)
    init_logger(__name__).info("%s: %d layers x %s %s = %s in %.2f s", what, len(caches), tuple(caches[0].shape),
                               str(dtype).split(".")[-1], format_bytes(total), time.perf_counter() - t0)
    return caches


def _zero_mapped(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of these shapes in one private anonymous mapping (each start 64-byte aligned); the tensors keep
    the mapping alive."""
    import math
    import mmap

    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64
    region = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(region, dtype=torch.uint8, count=total)
    return [flat[o:o + n].view(dtype).view(shape) for o, n, shape in zip(offsets, sizes, shapes)]
