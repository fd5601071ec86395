"""The 120 linears of one SmolLM2 step at 8 to 2,048 rows, per path: bf16 as the engine runs it (skinny, AMX
tiles, oneDNN past 128 rows) and forced onto AMX tiles; int8 and int4 (group 32) on the VNNI kernel, on the AMX
kernel over dequantized panels (quant_amx.cpp) and dequantized for oneDNN. Best of `reps`, ms, all paths
interleaved per row count so they share the machine's speed of the moment.

    python docs/benchmarks/2026-12-01-quant-amx/quant_paths_rows.py [rows,...] [reps]
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-01-prefetch"))
from step_linears import best_ms, random_layers  # noqa: E402

from tokenmill.kernels.build import load_cpu_kernels  # noqa: E402
from tokenmill.layers.linear import PackedWeight  # noqa: E402
from tokenmill.layers.quant import quantize_int4, quantize_int8  # noqa: E402
from tokenmill.layers.quant.kernel import QuantLinearKernel  # noqa: E402

load_cpu_kernels()


def vnni(k: QuantLinearKernel, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)


def amx(k: QuantLinearKernel, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.quant_amx_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group,
                                              k.out_features, False)


def bf16_tiles(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.amx_gemm(x, w.tiles, w.bias, w.out_features, False)


rows_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8, 16, 32, 64, 128, 256, 512, 2048]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
bf = random_layers(lambda w: PackedWeight(w.bfloat16(), None))
quant = {"int8": random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16)),
         "int4": random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))}
print(json.dumps({"time": time.strftime("%H:%M:%S")}))
for rows in rows_list:
    row = {"rows": rows, "bf16": round(best_ms(bf, lambda k, x: k(x), rows, reps), 2),
           "bf16_amx": round(best_ms(bf, bf16_tiles, rows, reps), 2)}
    for name, layers in quant.items():
        row[f"{name}_vnni"] = round(best_ms(layers, vnni, rows, reps), 2)
        row[f"{name}_amx"] = round(best_ms(layers, amx, rows, reps), 2)
        row[f"{name}_dequant"] = round(best_ms(layers, lambda k, x: k._dequantized_matmul(x), rows, reps), 2)
    print(json.dumps(row), flush=True)
