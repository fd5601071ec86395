"""The matmul of a quantized linear layer: the packed weight and the path each batch size takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tokenmill.kernels as kernels
from tokenmill.layers.quant.tensor import QuantizedWeight

# Past the VNNI kernel's rows (whose byte dot products run on the vector units: at 128 rows it takes 1.2x (int8)
# and 1.5x (int4) bf16's time) the weights are dequantized into panels of the tile layout as the matmul reaches
# them, and the bf16 tile matmul multiplies: on AMX up to QUANT_AMX_MAX_ROWS, and on AVX-512 BF16 vectors
# (vec_gemm.h) where the CPU has no AMX, at any batch. AMX: the 120 linears of a SmolLM2 step
# (e4626e1:docs/benchmarks/2026-12-01-quant-amx) at 16 rows take about as long either way, at 32 rows AMX takes half the
# VNNI kernel's time and at 128-256 rows a third to a half (as fast as bf16 weights); from ~512 rows on,
# dequantizing for oneDNN wins (2,048 rows: 0.75 vs 0.98-1.07 s). Vectors (AMD Zen 5,
# e4626e1:docs/benchmarks/2026-12-03-vec-gemm): int8 on the VNNI kernel is faster up to ~24 rows, int4 up to ~8; past
# them the vector matmul is as fast as bf16 weights at every size, and beats dequantizing for oneDNN to 2,048.
VNNI_MAX_ROWS_AMX = 16
QUANT_AMX_MAX_ROWS = 512
VNNI_MAX_ROWS_VEC = {8: 24, 4: 8}
# Larger batches dequantize up to this many bf16 bytes of w^T at a time (an lm head goes in several pieces),
# so the buffer oneDNN reads stays in the shared cache.
DEQUANT_CHUNK_BYTES = 8 << 20
_BLOCK = 16


def pack_for_kernels(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, scale, min in the kernels' VNNI layout (see quant_gemm.cpp): per block of 16 outputs, units of
    16 outputs x 4 consecutive inputs; 8-bit values as q + 128, 4-bit ones two units to a byte."""
    n, k = qw.q.shape
    blocks = n // _BLOCK
    if qw.bits == 8:
        u = (qw.q.to(torch.int16) + 128).to(torch.uint8).view(blocks, _BLOCK, k // 4, 4)
    else:
        halves = qw.q.to(torch.uint8).view(blocks, _BLOCK, k // 8, 2, 4)
        u = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
    q = u.permute(0, 2, 1, 3).contiguous().flatten()

    def groups(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.to(torch.float16).view(blocks, _BLOCK, -1).transpose(1, 2).contiguous()

    return q, groups(qw.scale), groups(qw.min)


def _gpu_kernel_takes(qw: QuantizedWeight, device: torch.device | str) -> bool:
    from tokenmill.kernels import gpu

    return (torch.device(device).type == "cuda" and gpu.available("cuda") and qw.group % gpu.QUANT_BLOCK_K == 0
            and qw.q.shape[1] % gpu.QUANT_BLOCK_K == 0)


class QuantLinearKernel:
    """y = x @ dequant(w)^T + b. Native (bf16 activations, 16-output blocks, groups of 32k): small batches on
    the VNNI kernel, which reads the packed bytes once per call; larger ones on the tile matmul over dequantized
    panels (AMX up to QUANT_AMX_MAX_ROWS, then w^T dequantized a cache-sized piece at a time for oneDNN's bf16
    matmul; without AMX the vector matmul at any size). Elsewhere (fp32, odd shapes, no kernels) the weight is
    kept dequantized in the model dtype and F.linear runs: the reference path. On a GPU with Triton the weight
    stays quantized there and the Triton matmul dequantizes it a tile at a time."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.out_features, self.in_features = qw.q.shape
        self.bits, self.group = qw.bits, qw.group
        self.bias = bias.detach().to(dtype) if bias is not None else None
        self.bias_f32 = self.bias.float() if self.bias is not None else None  # what the VNNI kernel adds
        self.native = (torch.device(device).type == "cpu" and dtype == torch.bfloat16
                       and self.out_features % _BLOCK == 0 and qw.group % 32 == 0 and kernels.quant_kernels_available())
        if self.native:
            self.q, self.scale, self.min = pack_for_kernels(qw)
            self.weight = None
            rows = max(_BLOCK, DEQUANT_CHUNK_BYTES // (2 * self.in_features) // _BLOCK * _BLOCK)
            blocks = self.out_features // _BLOCK
            step = rows // _BLOCK
            self.chunks = [(b, min(b + step, blocks)) for b in range(0, blocks, step)]
        self.gpu = None   # on a GPU with Triton: the weight kept quantized there (kernels/gpu/quant_matmul.py)
        if not self.native and _gpu_kernel_takes(qw, device):
            from tokenmill.kernels.gpu.quant_matmul import GpuQuantWeight

            self.gpu, self.weight = GpuQuantWeight.pack(qw, device), None
            self.bias = None if self.bias is None else self.bias.to(device)
        elif not self.native:
            self.weight = qw.dequantize().to(device, dtype)
        self.amx = self.native and kernels.amx_available()
        self.vnni_max_rows = VNNI_MAX_ROWS_AMX if self.amx else VNNI_MAX_ROWS_VEC[self.bits]
        self.max_rows = QUANT_AMX_MAX_ROWS if self.amx else kernels.ANY_ROWS  # the most rows a native kernel takes
        ops = kernels.ops() if self.native else None
        self.tile_gemm = ops.quant_amx_gemm if self.amx else (ops.quant_vec_gemm if self.native else None)
        self.small_gemm = ops.quant_gemm if self.native else None
        self.dequantize_t = ops.quant_dequantize_t if self.native else None
        self.gated_on_tiles = self.native and self.out_features % (2 * _BLOCK) == 0  # gate and up whole blocks

    @property
    def nbytes(self) -> int:
        if self.gpu is not None:
            return self.gpu.nbytes
        if not self.native:
            return self.weight.numel() * self.weight.element_size()
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpu is not None:
            flat = x.reshape(-1, x.shape[-1])
            return self.gpu.matmul(flat, self.bias).reshape(*x.shape[:-1], self.out_features)
        if not self.native:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if rows <= self.vnni_max_rows:
            return self.small_gemm(x, self.q, self.scale, self.min, self.bias_f32, self.bits,
                                                  self.group, self.out_features)
        if rows <= self.max_rows:
            return self.tile_gemm(x, self.q, self.scale, self.min, self.bias_f32, self.bits, self.group,
                                  self.out_features, False)
        return self._dequantized_matmul(x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for a weight that stacks gate over up, from the tile matmul's epilogue (the [M, 2I]
        product is never written); None where these rows take another path."""
        if not self.gated_on_tiles or x.dim() != 2 or not self.vnni_max_rows < x.shape[0] <= self.max_rows:
            return None
        return self.tile_gemm(x, self.q, self.scale, self.min, self.bias_f32, self.bits, self.group,
                              self.out_features, True)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = []
        for b0, b1 in self.chunks:
            w_t = self.dequantize_t(self.q, self.scale, self.min, self.bits, self.group,
                                                          self.out_features, self.in_features, b0, b1)
            if self.bias is None:
                parts.append(torch.mm(x, w_t))
            else:
                parts.append(torch.addmm(self.bias[b0 * _BLOCK: b1 * _BLOCK], x, w_t))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
