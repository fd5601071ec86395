"""The 120 linears of one SmolLM2 step at each row count: bf16 as the engine runs it, int8 and int4 (group 32) on
the VNNI kernel and dequantized for oneDNN. Best of 4 passes, ms.

    python quant_rows.py 16,32,64,128,256
"""
import json
import sys
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


bf = random_layers(lambda w: PackedWeight(w.bfloat16(), None))
quant = {"int8": random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16)),
         "int4": random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))}
for rows in [int(r) for r in sys.argv[1].split(",")]:
    row = {"rows": rows, "bf16": best_ms(bf, lambda k, x: k(x), rows, 4)}
    for name, layers in quant.items():
        row[name + "_vnni"] = best_ms(layers, vnni, rows, 4)
        row[name + "_dequant"] = best_ms(layers, lambda k, x: k._dequantized_matmul(x), rows, 4)
    print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
