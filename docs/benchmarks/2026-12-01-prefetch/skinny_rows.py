"""The skinny bf16 matmul against the AMX one at 1-8 rows, on the same tile-layout weights: the 120 linears of a
SmolLM2 decode step; best of 6, ms.

    python docs/benchmarks/2026-12-01-prefetch/skinny_rows.py
"""
import torch
from step_linears import best_ms, random_layers

from tokenmill.kernels.build import load_cpu_kernels
from tokenmill.layers.linear import PackedWeight

load_cpu_kernels()
layers = random_layers(lambda w: PackedWeight(w.bfloat16(), None))


def skinny(k: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.tiled_skinny_gemm(x, k.tiles, None, k.out_features)


def amx(k: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.amx_gemm(x, k.tiles, None, k.out_features, False)


for _ in range(3):
    print(" ".join(f"rows {m}: skinny {best_ms(layers, skinny, m):.2f} amx {best_ms(layers, amx, m):.2f} |"
                   for m in (1, 4, 5, 6, 8)))
