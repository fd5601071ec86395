"""The unquantized weight's kernel: the tile layout the native matmuls stream (skinny, AMX, vector) and oneDNN's
blocked layout for the rows they do not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tokenmill.kernels as kernels


def onednn_packing_helps(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight takes PackedWeight: the native tile kernels where they are built, and oneDNN's prepacked
    bf16 weights (which beat plain F.linear at every batch size, 1.5-4x at M=1) where the CPU runs them."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and (
        kernels.native_kernels_for(weight) or onednn_bf16())


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 here: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, not AVX2 alone."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Up to this many rows the native skinny matmul (a weight stream at 20-35 GB/s) beats oneDNN's blocked kernels;
# its rows do not change each other's bits, so drafts verified together get the bits of decoding them alone
# (speculation with up to 7 drafts stays lossless in bf16).
SKINNY_MAX_ROWS = 8
# Up to this many rows the AMX tile matmul beats oneDNN's: 10-40% faster at 8-128 rows with the weights cold
# in memory, as they are in a decode step (gate/up at 128 rows, with silu_and_mul after both: 0.77 vs 0.87 ms),
# but not on vocabulary-wide outputs (the lm head), where oneDNN's blocking wins from 128 rows on.
AMX_MAX_ROWS = 128
AMX_MAX_ROWS_WIDE = 96
WIDE_OUTPUT = 16384
# Without AMX the vector matmul over the same layout (vec_gemm.h) takes every batch past VEC_SKINNY_MAX_ROWS: on
# AMD Zen 5 the 120 linears of a SmolLM2 step ran 25-29% faster than oneDNN's at 16-64 rows, 12% at 128, 4-8% at
# 256-2,048, and the lm head no slower at any size (e4626e1:docs/benchmarks/2026-12-03-vec-gemm), so no oneDNN copy of a
# tiled weight is kept there. It also beats the skinny kernel from 5-6 rows (8 rows: 6.8 vs 8.5 ms) and gives its
# bits (each row summed alone in the same order), so drafts verified together keep their bits either way.
VEC_SKINNY_MAX_ROWS = 4


class PackedWeight:
    """A weight in the tile layout that the native kernels read as one sequential stream: the skinny matmul
    (1-8 rows), then the AMX matmul (up to AMX_MAX_ROWS) where the CPU has AMX; else the skinny matmul up to 4
    rows and the vector matmul past them (any batch); and in oneDNN's blocked layout for what they do not take
    (an AMX host's large batches, shapes the tiles do not fit, no native kernels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.bias = bias.detach() if bias is not None else None
        self.out_features, in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()  # what one pass streams (either layout)
        tileable = self.out_features % 16 == 0 and in_features % 32 == 0
        ops = kernels.ops()
        self.tiles = (ops.pack_tiles(weight.detach()) if tileable and kernels.native_kernels_for(weight) else None)
        self.tile_max_rows, self.tile_gemm, self.skinny_max_rows = 0, None, SKINNY_MAX_ROWS
        if self.tiles is not None and kernels.amx_available():
            self.tile_max_rows = AMX_MAX_ROWS if self.out_features < WIDE_OUTPUT else AMX_MAX_ROWS_WIDE
            self.tile_gemm = ops.amx_gemm
        elif self.tiles is not None:
            self.tile_max_rows, self.tile_gemm = kernels.ANY_ROWS, ops.vec_gemm
            self.skinny_max_rows = VEC_SKINNY_MAX_ROWS
        beyond_tiles = self.tile_max_rows < kernels.ANY_ROWS
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                       if beyond_tiles and onednn_bf16() else None)
        self.weight = weight.detach() if beyond_tiles and self.packed is None else None  # for F.linear
        self.gated_on_tiles = self.tiles is not None and self.out_features % 32 == 0  # gate, up: whole blocks
        self.skinny_gemm = ops.tiled_skinny_gemm if self.tiles is not None else None

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for a weight that stacks gate over up, computed in the tile matmul's epilogue (the
        [M, 2I] product is never written); None where these rows take another path. Unlike the plain linear it
        stays on AMX past AMX_MAX_ROWS: without the [M, 2I] round trip and the separate activation pass it beats
        oneDNN + silu_and_mul there too (2,048 rows of SmolLM2: 4.2 vs 5.0 ms)."""
        if not self.gated_on_tiles or x.dim() != 2 or x.shape[0] <= self.skinny_max_rows:
            return None
        return self.tile_gemm(x, self.tiles, self.bias, self.out_features, True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if rows <= self.tile_max_rows:
            if rows <= self.skinny_max_rows:
                return self.skinny_gemm(x, self.tiles, self.bias, self.out_features)
            return self.tile_gemm(x, self.tiles, self.bias, self.out_features)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
