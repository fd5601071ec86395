"""The 120 quantized linears of a SmolLM2 decode step (30 layers of random weights, so they stream from memory as
in a step) through the built kernel and through variants of quant_gemm.cpp built under other op names, alternated
8 times; prints best/median ms for int8 and int4.

    cp tokenmill/kernels/csrc/quant_gemm.cpp /tmp/qg_j1.cpp    # then edit the variant, and rename its ops:
    sed -i "s/TORCH_LIBRARY_FRAGMENT(tokenmill/TORCH_LIBRARY_FRAGMENT(qg_j1/;
        s/TORCH_LIBRARY_IMPL(tokenmill/TORCH_LIBRARY_IMPL(qg_j1/;
        s/namespace tokenmill_native/namespace qg_j1_native/" /tmp/qg_j1.cpp
    python docs/benchmarks/2026-12-03-vnni-stream/quant_step_ab.py qg_j1[,qg_other] [rows]
"""
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs/benchmarks/2026-12-01-prefetch"))
from step_linears import SHAPES, random_layers  # noqa: E402

from tokenmill.kernels.build import load_cpu_kernels  # noqa: E402
from tokenmill.layers.quant import quantize_int4, quantize_int8  # noqa: E402
from tokenmill.layers.quant.kernel import QuantLinearKernel  # noqa: E402

load_cpu_kernels()
ops = ["tokenmill"] + sys.argv[1].split(",")
for n in ops[1:]:
    cpp_extension.load(name=n, sources=[f"/tmp/{n}.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[str(ROOT / "tokenmill/kernels/csrc")],
                       is_python_module=False, verbose=False)
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
q8 = random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16))
q4 = random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))
x = {n: torch.randn(rows, s[1]).bfloat16() for n, s in SHAPES.items()}


def run(op: str, layers: dict) -> float:
    f = getattr(torch.ops, op).quant_gemm
    t = time.perf_counter()
    for i in range(30):
        for n in SHAPES:
            k = layers[n][i]
            f(x[n], k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)
    return time.perf_counter() - t


for name, layers in (("int8", q8), ("int4", q4)):
    res = {o: [] for o in ops}
    for _ in range(8):
        for o in ops:
            res[o].append(run(o, layers))
    print(name, f"rows {rows}: " + "  ".join(f"{o} {min(v) * 1e3:.2f}/{sorted(v)[4] * 1e3:.2f} ms"
                                             for o, v in res.items()), flush=True)
