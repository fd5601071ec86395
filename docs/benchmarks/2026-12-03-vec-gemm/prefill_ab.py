"""The built prompt-attention kernel (AVX-512 BF16) against variants of prefill_attention.cpp built under other op
names, alternated in one process: GFLOP/s of the causal work of one SmolLM2 layer (9 query heads, 3 KV heads),
best and median of `rounds`, and each variant's largest difference from the built kernel's output.

    cp tokenmill/kernels/csrc/prefill_attention.cpp /tmp/pa_v1.cpp   # edit, then rename its op namespace:
    sed -i "s/TORCH_LIBRARY_FRAGMENT(tokenmill/TORCH_LIBRARY_FRAGMENT(pa_v1/;
            s/TORCH_LIBRARY_IMPL(tokenmill/TORCH_LIBRARY_IMPL(pa_v1/" /tmp/pa_v1.cpp
    python prefill_ab.py pa_v1[,pa_v2] [rows:context,...] [rounds]
"""
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenmill.kernels.build import load_cpu_kernels

ROOT = Path(__file__).resolve().parents[3]
load_cpu_kernels()
variants = sys.argv[1].split(",")
for name in variants:
    cpp_extension.load(name=name, sources=[f"/tmp/{name}.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[str(ROOT / "tokenmill/kernels/csrc")],
                       is_python_module=False, verbose=False)
ops = {"built": torch.ops.tokenmill.prefill_attention, **{n: getattr(torch.ops, n).prefill_attention for n in variants}}
cases = [tuple(map(int, c.split(":"))) for c in (sys.argv[2] if len(sys.argv) > 2 else
                                                  "256:0,2048:0,2048:5888").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
g = torch.Generator().manual_seed(1)
for rows, ctx in cases:
    qkv = torch.randn(ctx + rows, 960, generator=g).bfloat16()
    k, v = qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)
    q = qkv[ctx:, :576].view(-1, 9, 64)
    flop = 4 * 9 * 64 * (rows * ctx + rows * rows / 2)
    n = max(2, int(5e9 / flop))
    outs = {name: torch.empty(rows, 9, 64, dtype=torch.bfloat16) for name in ops}
    rates = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            op(outs[name], q, k, v, 0.125, ctx)
            t = time.perf_counter()
            for _ in range(n):
                op(outs[name], q, k, v, 0.125, ctx)
            rates[name].append(flop / ((time.perf_counter() - t) / n) / 1e9)
    diffs = {name: (outs[name].float() - outs["built"].float()).abs().max().item() for name in variants}
    print(f"{rows} rows after {ctx}: " + "  ".join(
        f"{name} {max(r):.0f}/{statistics.median(r):.0f}" for name, r in rates.items()) + f"  max diff {diffs}",
          flush=True)
