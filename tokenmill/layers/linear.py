"""Linear layers whose parameters carry a `weight_loader`: the seam where fused shards (and later
tensor-parallel slicing and quantization) hook into weight loading."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tokenmill.kernels as kernels


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match the parameter's {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


def onednn_packing_helps(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked bf16 weights beat plain F.linear on CPU at every batch size (1.5-4x at M=1)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


# Up to this many rows the native skinny matmul (a weight stream at 20-35 GB/s) beats oneDNN's blocked kernels.
SKINNY_MAX_ROWS = 4
# Up to this many rows the AMX tile matmul beats oneDNN's: 10-40% faster at 8-128 rows with the weights cold
# in memory, as they are in a decode step (gate/up at 128 rows, with silu_and_mul after both: 0.77 vs 0.87 ms),
# but not on vocabulary-wide outputs (the lm head), where oneDNN's blocking wins from 128 rows on.
AMX_MAX_ROWS = 128
AMX_MAX_ROWS_WIDE = 96
WIDE_OUTPUT = 16384


class PackedWeight:
    """A weight in oneDNN's blocked layout for large batches, and, where the native kernels run, in the AMX tile
    layout that the skinny matmul (1-4 rows) and the AMX matmul (up to AMX_MAX_ROWS, where the CPU has AMX)
    read as one sequential stream."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = bias.detach() if bias is not None else None
        self.out_features, in_features = weight.shape
        tileable = self.out_features % 16 == 0 and in_features % 32 == 0
        self.tiles = (torch.ops.tokenmill.pack_tiles(weight.detach())
                      if tileable and kernels.native_kernels_for(weight) else None)
        amx = self.tiles is not None and kernels.amx_available()
        amx_rows = AMX_MAX_ROWS if self.out_features < WIDE_OUTPUT else AMX_MAX_ROWS_WIDE
        self.tile_max_rows = amx_rows if amx else SKINNY_MAX_ROWS
        self.gated_on_amx = amx and self.out_features % 32 == 0  # gate and up each whole 16-output blocks

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for a weight that stacks gate over up, computed in the AMX matmul's epilogue (the
        [M, 2I] product is never written); None where these rows take another path. Unlike the plain linear it
        stays on AMX past AMX_MAX_ROWS: without the [M, 2I] round trip and the separate activation pass it beats
        oneDNN + silu_and_mul there too (2,048 rows of SmolLM2: 4.2 vs 5.0 ms)."""
        if not self.gated_on_amx or x.dim() != 2 or x.shape[0] <= SKINNY_MAX_ROWS:
            return None
        return torch.ops.tokenmill.amx_gemm(x, self.tiles, self.bias, self.out_features, True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if self.tiles is not None and rows <= self.tile_max_rows:
            gemm = torch.ops.tokenmill.tiled_skinny_gemm if rows <= SKINNY_MAX_ROWS else torch.ops.tokenmill.amx_gemm
            return gemm(x, self.tiles, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: PackedWeight | None = None

    def process_weights_after_loading(self) -> None:
        """Called once the checkpoint is in: the place for layout changes (and, later, quantization)."""
        if onednn_packing_helps(self.weight):
            self.packed = PackedWeight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked into one matmul (q/k/v, or gate/up); shards load by index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.offsets[shard], self.out_sizes[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard}: weight shape {tuple(loaded.shape)} does not fit rows {size} of "
                             f"{tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.out_sizes, dim=-1)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Statistics in fp32, as transformers computes them, whatever the model dtype.

    Given a residual, it first adds x into it (`residual = x + residual`) and normalizes the sum: the pre-norm
    decoder's add and norm are one pass over the row in the native bf16 kernel."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.native = False

    def process_weights_after_loading(self) -> None:
        self.native = kernels.native_kernels_for(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self.native:
                torch.ops.tokenmill.add_rms_norm(x, residual, self.weight, self.eps)  # both in place
                return x, residual
            residual = x + residual
            return self._norm(residual), residual
        if self.native and x.dim() == 2:
            out = torch.empty_like(x)
            torch.ops.tokenmill.rms_norm(out, x, self.weight, self.eps)
            return out
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # transformers' exact sequence of operations
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, fp32 statistics inside
