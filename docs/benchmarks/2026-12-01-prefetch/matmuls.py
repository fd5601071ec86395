"""The 120 linears of one SmolLM2 decode step (30 layers of distinct random weights, so they stream from memory
as in a step) at 1, 2, 4, 16 and 64 rows: bf16 on the tile layout, int8 and int4 on the VNNI kernel; best of 6, ms.
Run it under two checkouts alternately to compare their kernels in one window (run_ab.sh does).

    python docs/benchmarks/2026-12-01-prefetch/matmuls.py [tag]
"""
import json
import sys
import time

import torch

from tokenmill.kernels.build import load_cpu_kernels
from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.quant import quantize_int4, quantize_int8
from tokenmill.layers.quant.kernel import QuantLinearKernel

load_cpu_kernels()
torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
W = {n: [torch.randn(*s) * 0.05 for _ in range(30)] for n, s in shapes.items()}


def vnni(k: QuantLinearKernel, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)


def bench(ks, call, rows, reps=6) -> float:
    x = {n: torch.randn(rows, s[1]).bfloat16() for n, s in shapes.items()}
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(30):
            for n in shapes:
                call(ks[n][i], x[n])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


bf = {n: [PackedWeight(w.bfloat16(), None) for w in ws] for n, ws in W.items()}
i8 = {n: [QuantLinearKernel(quantize_int8(w), None, torch.bfloat16) for w in ws] for n, ws in W.items()}
i4 = {n: [QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16) for w in ws] for n, ws in W.items()}
out = {"tag": sys.argv[1] if len(sys.argv) > 1 else "", "time": time.strftime("%H:%M:%S")}
for rows in (1, 2, 4, 16, 64):
    out[f"rows{rows}"] = {"bf16": round(bench(bf, lambda k, x: k(x), rows), 2),
                          "int8": round(bench(i8, vnni, rows), 2), "int4": round(bench(i4, vnni, rows), 2)}
print(json.dumps(out))
