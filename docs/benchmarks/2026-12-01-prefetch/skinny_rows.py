"""The skinny bf16 matmul against the AMX one at 1-8 rows, on the same tile-layout weights: the 120 linears of a
SmolLM2 decode step (30 layers of distinct random weights, streamed from memory as in a step); best of 6, ms.

    python docs/benchmarks/2026-12-01-prefetch/skinny_rows.py
"""
import time

import torch

from tokenmill.kernels.build import load_cpu_kernels
from tokenmill.layers.linear import PackedWeight

load_cpu_kernels()
torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
W = {n: [PackedWeight((torch.randn(*s) * 0.05).bfloat16(), None) for _ in range(30)] for n, s in shapes.items()}


def bench(call, rows, reps=6) -> float:
    x = {n: torch.randn(rows, s[1]).bfloat16() for n, s in shapes.items()}
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(30):
            for n in shapes:
                k = W[n][i]
                call(x[n], k.tiles, None, k.out_features)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


skinny = torch.ops.tokenmill.tiled_skinny_gemm


def amx(x, tiles, bias, n):
    return torch.ops.tokenmill.amx_gemm(x, tiles, bias, n, False)


for _ in range(3):
    print(" ".join(f"rows {m}: skinny {bench(skinny, m):.2f} amx {bench(amx, m):.2f} |" for m in (1, 4, 5, 6, 8)))
