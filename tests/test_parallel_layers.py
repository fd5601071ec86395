"""The pieces of tensor and pipeline parallel that need no second process: each rank's shard of a weight (float or
quantized blocks) as its weight_loader takes it, the KV-head assignment, the stage split and the CPU shares.
Ranks are simulated by setting this process's tensor-parallel group info."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.config import ParallelConfig
from tokenmill.distributed import parallel_state
from tokenmill.distributed.parallel_state import GroupInfo
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.quant.methods import GGUFMethod
from tokenmill.layers.quant.tensor import quantize_int4
from tokenmill.model.llama_layers import qkv_rank_rows
from tokenmill.platform import rank_cpus


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank: int, size: int = 2) -> None:
        monkeypatch.setattr(parallel_state, "_tp", GroupInfo(rank, size, tuple(range(size))))
    return set_rank


def test_quantized_shards_are_slices_of_the_dequantized_weight():
    torch.manual_seed(0)
    qw = quantize_int4(torch.randn(40, 128), 32)
    full = qw.dequantize()
    torch.testing.assert_close(qw.row_range(8, 16).dequantize(), full[8:24], rtol=0, atol=0)
    padded = qw.row_range(32, 16).dequantize()   # 8 real rows, then 8 zero rows
    torch.testing.assert_close(padded[:8], full[32:], rtol=0, atol=0)
    assert not padded[8:].any()
    torch.testing.assert_close(qw.col_range(64, 64).dequantize(), full[:, 64:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole groups of 32"):
        qw.col_range(16, 64)


@pytest.mark.parametrize("quantized", [False, True])
def test_column_and_row_shards_sum_to_the_whole_layer(as_rank, quantized):
    """Column-parallel then row-parallel over 2 ranks: the row layer's partial outputs (what the all-reduce sums)
    add up to the unsplit layers' output; GGUF-style blocks are sliced at group boundaries."""
    torch.manual_seed(0)
    up, down = torch.randn(64, 96), torch.randn(96, 64)
    x = torch.randn(3, 96)
    if quantized:
        up_q, down_q = quantize_int4(up, 32), quantize_int4(down, 32)
        up, down = up_q.dequantize(), down_q.dequantize()
    bias = torch.randn(96)
    partial = []
    for rank in (0, 1):
        as_rank(rank)
        col, row = Linear(96, 64, parallel="column"), Linear(64, 96, bias=True, parallel="row")
        for layer, w in ((col, up_q if quantized else up), (row, down_q if quantized else down)):
            layer.quant_method = GGUFMethod()
            layer.weight.weight_loader(layer.weight, w)
        row.bias.weight_loader(row.bias, bias)
        col.process_weights_after_loading()
        row.process_weights_after_loading()
        partial.append(row.kernel(col.kernel(x)))   # the kernels: no all-reduce in one process
    torch.testing.assert_close(partial[0] + partial[1], F.linear(F.linear(x, up), down, bias), rtol=1e-4, atol=1e-4)


def test_kv_heads_split_or_replicated(as_rank):
    # 8 query heads, 2 KV heads, head_dim 4, over 4 ranks: two ranks share each KV head
    rows = []
    for rank in range(4):
        as_rank(rank, 4)
        rows.append(qkv_rank_rows(8, 2, 4))
    assert [r[0] for r in rows] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert [r[1] for r in rows] == [(0, 4), (0, 4), (4, 4), (4, 4)]
    as_rank(1, 2)
    assert qkv_rank_rows(8, 2, 4) == [(16, 16), (4, 4), (4, 4)]


def test_merged_column_layer_loads_each_shard_slice(as_rank):
    as_rank(1)
    layer = MergedLinear(8, [4, 6], parallel="column")
    a, b = torch.arange(32.0).view(4, 8), 100 + torch.arange(48.0).view(6, 8)
    layer.weight.weight_loader(layer.weight, a, 0)
    layer.weight.weight_loader(layer.weight, b, 1)
    assert layer.out_sizes == [2, 3]
    torch.testing.assert_close(layer.weight.data, torch.cat([a[2:], b[3:]]))


def test_stage_split_and_cpu_shares():
    p = ParallelConfig(pipeline_parallel_size=4)
    stages = [p.stage_layers(30, s) for s in range(4)]
    assert [len(s) for s in stages] == [8, 8, 7, 7]
    assert [i for s in stages for i in s] == list(range(30))
    assert rank_cpus([0, 1, 2, 3, 4], 0, 2) == [0, 1, 2] and rank_cpus([0, 1, 2, 3, 4], 1, 2) == [3, 4]
    assert rank_cpus([0, 1], 1, 4) == [1]
