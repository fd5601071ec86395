"""A quantized weight as plain values (one integer per weight, a scale and a minimum per group), the form that
quantization at load, GGUF's blocks and the reference path share before the kernels repack it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Scales and minimums are stored as fp16 by the kernels (as GGUF stores them); they are rounded to it here, so
# the integers are chosen against the scale the kernels will really use.
_SCALE_DTYPE = torch.float16
_FP16_MAX = 65504.0


@dataclass
class QuantizedWeight:
    """w[n, k] = scale[n, k // group] * q[n, k] (+ min[n, k // group] at 4 bits).

    q: int8 [N, K]: -128..127 at 8 bits, 0..15 at 4 bits. scale, min: float32 [N, K // group], fp16 values."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: the reference every kernel is tested against."""
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.group, self.group) * self.scale.unsqueeze(-1)
        if self.min is not None:
            w = w + self.min.unsqueeze(-1)
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight with its output rows reordered (or selected): every part is indexed by output row."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index].contiguous()

        return QuantizedWeight(pick(self.q), pick(self.scale), pick(self.min), self.bits, self.group)

    def row_range(self, start: int, size: int) -> QuantizedWeight:
        """Output rows start..start+size (a tensor-parallel shard), zero rows (weight 0) past the end."""
        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            p = t[start:start + size]
            return torch.cat([p, p.new_zeros(size - p.shape[0], *p.shape[1:])]) if p.shape[0] < size else p

        return QuantizedWeight(part(self.q), part(self.scale), part(self.min), self.bits, self.group)

    def col_range(self, start: int, size: int) -> QuantizedWeight:
        """Input columns start..start+size: whole groups only, each keeping its own scale and minimum."""
        if start % self.group or size % self.group:
            raise ValueError(f"a tensor-parallel shard of {size} inputs does not hold whole groups of {self.group}")
        g0, g1 = start // self.group, (start + size) // self.group

        def cols(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, g0:g1].contiguous()

        return QuantizedWeight(self.q[:, start:start + size].contiguous(), cols(self.scale), cols(self.min),
                               self.bits, self.group)

    def same_kind(self, other: QuantizedWeight) -> bool:
        return (self.bits, self.group, self.min is None) == (other.bits, other.group, other.min is None) \
            and self.q.shape[1] == other.q.shape[1]


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack fused projections (q/k/v, gate/up) along the outputs; they must be quantized alike."""
    first = parts[0]
    for p in parts[1:]:
        if not first.same_kind(p):
            raise ValueError(f"the projections of one fused layer are quantized differently ({first.bits} bits, "
                             f"group {first.group} vs {p.bits} bits, group {p.group})")
    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat(ts)

    return QuantizedWeight(cat([p.q for p in parts]), cat([p.scale for p in parts]), cat([p.min for p in parts]),
                           first.bits, first.group)


def _to_scale(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-_FP16_MAX, _FP16_MAX).to(_SCALE_DTYPE).float()


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output channel (the group is the whole input)."""
    w = w.float()
    n, k = w.shape
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = _to_scale(absmax / 127.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, q = 0
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scale, None, 8, k)


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    """Asymmetric, groups of `group` inputs: w ~ scale * q + min with q in 0..15 (min is the zero point, kept as
    a float like GGUF's Q4_1, so a group's range is used whole)."""
    w = w.float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the layer's input size {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    mn = _to_scale(lo)
    scale = _to_scale((hi - mn) / 15.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - mn.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.int8)
    return QuantizedWeight(q.view(n, k), scale, mn, 4, group)
