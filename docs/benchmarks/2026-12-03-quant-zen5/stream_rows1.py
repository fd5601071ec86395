"""One decode row through the 120 linears of a SmolLM2 step: bf16 (the skinny tile kernel), int8 and int4 (the
VNNI kernel), each with the rate it reads its bytes at, beside a plain read of as many bytes as bf16's.

    python stream_rows1.py
"""
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


def megabytes(layers: dict) -> float:
    return sum(k.nbytes for ks in layers.values() for k in ks) / 1e6


bf = random_layers(lambda w: PackedWeight(w.bfloat16(), None))
q8 = random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16))
q4 = random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))
plain = torch.ones(int(megabytes(bf) * 1e6) // 4)
print("MB", megabytes(bf), megabytes(q8), megabytes(q4))
for _ in range(4):
    t = time.perf_counter()
    plain.sum()
    read = (time.perf_counter() - t) * 1e3
    times = {"bf16": (best_ms(bf, lambda k, x: k(x), 1, 5), bf), "int8": (best_ms(q8, vnni, 1, 5), q8),
             "int4": (best_ms(q4, vnni, 1, 5), q4)}
    print(f"plain read {read:.2f} ms ({megabytes(bf) / read:.1f} GB/s); "
          + "; ".join(f"{n} {ms:.2f} ms ({megabytes(ls) / ms:.1f} GB/s)" for n, (ms, ls) in times.items()))
