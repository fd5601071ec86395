"""The tied lm head of SmolLM2 (49,152 x 576) at one row, cold (96 MB written between calls): bf16's skinny kernel,
the built int8 VNNI kernel and variants of quant_gemm.cpp built as quant_step_ab.py's docstring says; best and
median of 7, alternated.

    python docs/benchmarks/2026-12-03-vnni-stream/lm_head_ab.py [variant,...]
"""
import sys
import time

import torch
from torch.utils import cpp_extension

from tokenmill.kernels.build import load_cpu_kernels
from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.quant import quantize_int8
from tokenmill.layers.quant.kernel import QuantLinearKernel

load_cpu_kernels()
torch.manual_seed(0)
w = torch.randn(49152, 576) * 0.05
bf = PackedWeight(w.bfloat16(), None)
q8 = QuantLinearKernel(quantize_int8(w), None, torch.bfloat16)
ops = sys.argv[1].split(",") if len(sys.argv) > 1 else []
for n in ops:
    cpp_extension.load(name=n, sources=[f"/tmp/{n}.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=["tokenmill/kernels/csrc"],
                       is_python_module=False, verbose=False)
junk = torch.ones(96 * 1024 * 1024 // 4)
x = torch.randn(1, 576).bfloat16()


def int8_call(name: str):
    f = getattr(torch.ops, name).quant_gemm
    return lambda: f(x, q8.q, q8.scale, q8.min, q8.bias_f32, 8, q8.group, 49152)


calls = {"bf16": lambda: bf(x), "int8": int8_call("tokenmill"), **{n: int8_call(n) for n in ops}}
ref = calls["int8"]()
assert all(torch.equal(calls[n](), ref) for n in ops), "a variant changed the bits"
res = {n: [] for n in calls}
for _ in range(7):
    for n, f in calls.items():
        junk.add_(1.0)
        t = time.perf_counter()
        f()
        res[n].append(time.perf_counter() - t)
for n, v in res.items():
    mb = 49152 * 576 * (2 if n == "bf16" else 1) / 1e6
    print(f"{n}: best {min(v) * 1e3:.3f} ms ({mb / min(v) / 1e3:.1f} GB/s), median {sorted(v)[3] * 1e3:.3f} ms")
