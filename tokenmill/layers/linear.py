"""Linear layers whose parameters carry a `weight_loader`: the seam where fused shards, quantized tensors and
tensor-parallel slicing hook into weight loading. Each layer's `quant_method` turns the loaded weight into the
kernel its forward calls.

Tensor parallel (`parallel=`): a "column" layer keeps its rank's rows of the output (zero-padded past the end,
so a vocabulary need not divide), a "row" layer its rank's columns of the input and sums its partial output over
the group (the bias is added once, by the first rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tokenmill.kernels as kernels
from tokenmill.distributed.comm import tp_all_reduce
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.methods import UnquantizedMethod
from tokenmill.layers.quant.tensor import QuantizedWeight, concat_rows


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight) -> None:
    if isinstance(loaded, QuantizedWeight):
        loaded = loaded.dequantize()
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match the parameter's {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


def take_rows(t: torch.Tensor | QuantizedWeight, start: int, size: int) -> torch.Tensor | QuantizedWeight:
    """Rows start..start+size of a checkpoint tensor (a rank's shard), zero rows past its end."""
    if isinstance(t, QuantizedWeight):
        return t.row_range(start, size)
    part = t[start:start + size]
    if part.shape[0] < size:
        part = torch.cat([part, part.new_zeros(size - part.shape[0], *part.shape[1:])])
    return part


def take_cols(t: torch.Tensor | QuantizedWeight, start: int, size: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(t, QuantizedWeight):
        return t.col_range(start, size)
    return t[:, start:start + size]


def split_size(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"tensor_parallel_size {parts} does not divide {what} ({size})")
    return size // parts


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None):
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.parallel = parallel if tp.size > 1 else None
        self.reduce = True   # a row-parallel layer whose partial sum another layer reduces sets this False
        if self.parallel == "column":   # ceil: a vocabulary-wide head pads its last shard
            out_features = -(-out_features // tp.size)
        elif self.parallel == "row":
            in_features = split_size(in_features, tp.size, "a row-parallel layer's input")
        self.in_features, self.out_features = in_features, out_features   # this rank's
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self._load_weight
        self.bias = _param(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias
        self.quant_method = UnquantizedMethod()   # the loader attaches the engine's method
        self.layer_name = type(self).__name__
        self.quantized: dict[int, QuantizedWeight] = {}   # shard -> tensor a GGUF file holds in blocks
        self.kernel = None
        self.lora = None   # lora.layers.LoRALinearWeights when the engine serves adapters

    @property
    def lora_active(self) -> bool:
        """Whether this step adds adapters' products to this layer's output (a fused epilogue must step aside)."""
        return self.lora is not None and self.lora.step.active

    def _shard(self, loaded, shard: int):
        """This rank's part of a checkpoint tensor (of fused shard `shard`)."""
        if self.parallel == "column":
            start, size = self._rank_rows(shard)
            return take_rows(loaded, start, size)
        if self.parallel == "row" and len(loaded.shape) == 2:   # a bias is whole on every rank
            size = self.weight.shape[1]
            return take_cols(loaded, self.tp_rank * size, size)
        return loaded

    def _rank_rows(self, shard: int) -> tuple[int, int]:
        size = self.weight.shape[0]
        return self.tp_rank * size, size

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        self._copy_shard(param, self._shard(loaded, shard) if self.parallel == "column" else loaded, shard)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight, shard: int = 0) -> None:
        loaded = self._shard(loaded, shard)
        if isinstance(loaded, QuantizedWeight):
            self._check_shard_shape(loaded.shape, shard)
            self.quantized[shard] = loaded
        else:
            self._copy_shard(param, loaded, shard)

    def _check_shard_shape(self, shape: tuple[int, ...], shard: int) -> None:
        if tuple(shape) != tuple(self.weight.shape):
            raise ValueError(f"weight shape {tuple(shape)} does not match the parameter's {tuple(self.weight.shape)}")

    def _copy_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        default_weight_loader(param, loaded)

    def _num_shards(self) -> int:
        return 1

    def _quantized_weight(self) -> QuantizedWeight | None:
        if not self.quantized:
            return None
        if len(self.quantized) != self._num_shards():
            raise ValueError(f"{self.layer_name}: some projections are quantized blocks and some are floats")
        return concat_rows([self.quantized[i] for i in range(self._num_shards())])

    def process_weights_after_loading(self) -> None:
        """Called once the checkpoint is in: the quant method makes the kernel (a packed or quantized copy)."""
        if self.parallel == "row" and self.tp_rank != 0:
            self.bias = None   # added once to the sum, by the first rank
        self.kernel = self.quant_method.make_kernel(self.layer_name, self.weight, self.bias, self._quantized_weight())
        self.quantized = {}
        if isinstance(self.kernel, QuantLinearKernel):  # the float weight is no longer read
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        return tp_all_reduce(y) if self.parallel == "row" and self.reduce else y


class MergedLinear(Linear):
    """Several projections of one input stacked into one matmul (q/k/v, or gate/up); shards load by index.

    Column-parallel, each rank keeps `rank_rows[i]` = (start, size) of checkpoint shard i (default: an even
    split); `out_sizes` are then this rank's sizes."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, parallel: str | None = None,
                 rank_rows: list[tuple[int, int]] | None = None):
        tp = get_tp()
        if parallel == "column" and tp.size > 1:
            if rank_rows is None:
                sizes = [split_size(o, tp.size, "a fused projection") for o in out_sizes]
                rank_rows = [(tp.rank * s, s) for s in sizes]
            out_sizes = [size for _, size in rank_rows]
        super().__init__(in_features, sum(out_sizes), bias)   # (sizes already this rank's)
        self.parallel = parallel if tp.size > 1 else None
        self.rank_rows = rank_rows
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def _rank_rows(self, shard: int) -> tuple[int, int]:
        return self.rank_rows[shard]

    def _num_shards(self) -> int:
        return len(self.out_sizes)

    def _check_shard_shape(self, shape: tuple[int, ...], shard: int) -> None:
        if shape[0] != self.out_sizes[shard] or tuple(shape[1:]) != tuple(self.weight.shape[1:]):
            raise ValueError(f"shard {shard}: weight shape {tuple(shape)} does not fit rows {self.out_sizes[shard]} "
                             f"of {tuple(self.weight.shape)}")

    def _copy_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.offsets[shard], self.out_sizes[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard}: weight shape {tuple(loaded.shape)} does not fit rows {size} of "
                             f"{tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.out_sizes, dim=-1)


class Embedding(nn.Module):
    """Under tensor parallel each rank holds a contiguous slice of the vocabulary (the last one zero-padded):
    a rank looks up the ids in its slice, zeros elsewhere, and the sum over the group is the embedding. A tied
    lm head made from it gives each rank's slice of the logits."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        tp = get_tp()
        self.tp_size = tp.size
        self.num_embeddings = num_embeddings
        local = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * local
        self.vocab_end = min(self.vocab_start + local, num_embeddings)
        self.weight = _param(local, dim)
        self.weight.weight_loader = self._load_weight
        self.quantized: QuantizedWeight | None = None  # kept for a tied lm head when the file holds blocks

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight) -> None:
        if self.tp_size > 1:
            loaded = take_rows(loaded, self.vocab_start, self.weight.shape[0])
        if isinstance(loaded, QuantizedWeight):
            self.quantized = loaded
        default_weight_loader(param, loaded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        x = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        return tp_all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


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
        self.ops = kernels.ops() if self.native else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self.native:
                self.ops.add_rms_norm(x, residual, self.weight, self.eps)  # both in place
                return x, residual
            residual = x + residual
            return self._norm(residual), residual
        if self.native and x.dim() == 2:
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, self.weight, self.eps)
            return out
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # transformers' exact sequence of operations
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, fp32 statistics inside
