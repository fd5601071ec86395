"""The 120 linears of a SmolLM2 step at 1-8 rows: the skinny kernel against the vector matmul (the same bits),
alternated, best / median of 5 rounds, ms.   python skinny_vs_vec.py"""
import statistics
import sys

import torch

sys.path.insert(0, "/work/main/docs/benchmarks/2026-12-01-prefetch")
from step_linears import best_ms, random_layers  # noqa: E402

from tokenmill.kernels.build import load_cpu_kernels  # noqa: E402

load_cpu_kernels()
T = torch.ops.tokenmill
bfl = random_layers(lambda w: T.pack_tiles(w.bfloat16()))


def vec(t, x):
    return T.vec_gemm(x, t, None, t.numel() // x.shape[1])


def skinny(t, x):
    return T.tiled_skinny_gemm(x, t, None, t.numel() // x.shape[1])


for rows in (1, 2, 4, 6, 8):
    res = {}
    for _ in range(5):
        for name, f in (("skinny", skinny), ("vec", vec)):
            res.setdefault(name, []).append(best_ms(bfl, f, rows, 2))
    print(rows, {k: (round(min(v), 2), round(statistics.median(v), 2)) for k, v in res.items()}, flush=True)
