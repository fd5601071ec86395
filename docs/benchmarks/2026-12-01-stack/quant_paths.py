"""The quantized linears' two paths at decode batch sizes, against bf16's AMX tiles: 30 layers of SmolLM2's shapes
(distinct random weights, so they stream from memory as in a step), best of 4, ms for all 120 matmuls. ("vnni"
calls the VNNI kernel whatever the rows; "deq" the dequantize-then-oneDNN path.)

    python docs/benchmarks/2026-12-01-stack/quant_paths.py
"""
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


def bench(ks, call, rows, reps=4):
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
for rows in (16, 32, 64, 128, 256):
    r = [bench(bf, lambda k, x: k(x), rows),
         bench(i8, vnni, rows), bench(i8, lambda k, x: k._dequantized_matmul(x), rows),
         bench(i4, vnni, rows), bench(i4, lambda k, x: k._dequantized_matmul(x), rows)]
    print(f"rows {rows}: bf16 {r[0]:.1f}  int8 vnni {r[1]:.1f} deq {r[2]:.1f}  int4 vnni {r[3]:.1f} deq {r[4]:.1f} ms")
