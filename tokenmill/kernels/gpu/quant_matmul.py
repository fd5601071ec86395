"""The int8 / int4 weight matmul in Triton: y = x @ dequant(w)^T, with w kept quantized in GPU memory (int8 a
byte a weight, int4 two to a byte along the inputs, an fp16 scale and minimum per group of inputs) and
dequantized a tile at a time in registers, so a decode step reads a quarter or half of bf16's bytes.

The quantized form is QuantizedWeight's (layers/quant/tensor.py): w[n, k] = scale[n, k // group] * q[n, k]
(+ min[n, k // group]); every group is a multiple of BLOCK_K, so a tile's inputs share one scale per output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.gpu import QUANT_BLOCK_K as BLOCK_K

BLOCK_N = 64


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, scale_ptr, min_ptr, bias_ptr, y_ptr, M, N, K,
                         stride_xm, stride_qn, stride_sn, stride_ym, group,
                         BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        if BITS == 8:
            q = tl.load(q_ptr + rn[None, :] * stride_qn + k[:, None], mask=n_ok[None, :], other=0)
            w = q.to(tl.float32)
        else:   # two inputs a byte: the even one in the low nibble
            b = tl.load(q_ptr + rn[None, :] * stride_qn + (k // 2)[:, None], mask=n_ok[None, :], other=0)
            w = ((b.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 15).to(tl.float32)
        g = k0 // group
        scale = tl.load(scale_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        w = w * scale[None, :]
        if HAS_MIN:
            w += tl.load(min_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.dot(x.to(tl.float32), w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass
class GpuQuantWeight:
    """A QuantizedWeight in the kernel's layout on its device."""

    q: torch.Tensor            # int8 [N, K] (8 bits) or uint8 [N, K // 2] (4 bits)
    scale: torch.Tensor        # fp16 [N, K // group]
    min: torch.Tensor | None   # fp16 [N, K // group] or None
    bits: int
    group: int
    in_features: int

    @classmethod
    def pack(cls, qw, device: str | torch.device) -> GpuQuantWeight:
        n, k = qw.q.shape
        if qw.group % BLOCK_K or k % BLOCK_K:
            raise ValueError(f"the GPU quantized matmul needs groups of a multiple of {BLOCK_K} inputs, got {qw.group}")
        if qw.bits == 8:
            q = qw.q.to(torch.int8)
        else:
            u = qw.q.to(torch.uint8).view(n, k // 2, 2)
            q = u[..., 0] | (u[..., 1] << 4)
        scale = qw.scale.to(torch.float16)
        mins = None if qw.min is None else qw.min.to(torch.float16)
        return cls(q.contiguous().to(device), scale.contiguous().to(device),
                   None if mins is None else mins.contiguous().to(device), qw.bits, qw.group, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K] (any float dtype, contiguous rows); returns [M, N] in x's dtype."""
        m, k = x.shape
        n = self.q.shape[0]
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _quant_matmul_kernel[grid](
            x, self.q, self.scale, self.min if self.min is not None else self.scale,
            bias if bias is not None else self.scale, y, m, n, k,
            x.stride(0), self.q.stride(0), self.scale.stride(0), y.stride(0), self.group,
            BITS=self.bits, HAS_MIN=self.min is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        return y
