"""The 120 linears of one SmolLM2 decode step at 1, 2, 4, 16 and 64 rows: bf16 on the tile layout, int8 and int4
on the VNNI kernel; best of 6, ms. Run it under two checkouts alternately to compare their kernels in one
window (run_ab.sh does).

    python docs/benchmarks/2026-12-01-prefetch/matmuls.py [tag]
"""
import json
import sys
import time

import torch
from step_linears import best_ms, random_layers

from tokenmill.kernels.build import load_cpu_kernels
from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.quant import quantize_int4, quantize_int8
from tokenmill.layers.quant.kernel import QuantLinearKernel

load_cpu_kernels()


def vnni(k: QuantLinearKernel, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)


bf = random_layers(lambda w: PackedWeight(w.bfloat16(), None))
i8 = random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16))
i4 = random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))
out = {"tag": sys.argv[1] if len(sys.argv) > 1 else "", "time": time.strftime("%H:%M:%S")}
for rows in (1, 2, 4, 16, 64):
    out[f"rows{rows}"] = {"bf16": round(best_ms(bf, lambda k, x: k(x), rows), 2),
                          "int8": round(best_ms(i8, vnni, rows), 2), "int4": round(best_ms(i4, vnni, rows), 2)}
print(json.dumps(out))
