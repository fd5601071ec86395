"""The prompt kernel (prefill_attention.cpp, AVX-512 BF16) as built now against the same file at an older
revision, built under another op namespace, alternated call by call in one process; the ratio of each pair's
times (new / old), median and quartiles over 40 pairs. Outputs must match bit for bit.

    python docs/benchmarks/2026-12-03-sweeps/zigzag_ab.py [REV]     (REV: default c799a40~1)
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenmill.kernels.build import load_cpu_kernels

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "tokenmill/kernels/csrc"
rev = sys.argv[1] if len(sys.argv) > 1 else "c799a40~1"
tmp = Path(tempfile.mkdtemp())
(tmp / "inc").mkdir()
for name in ("prefill_attention.cpp", "prefill_kv.h"):
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:tokenmill/kernels/csrc/{name}"],
                          capture_output=True, text=True, check=True).stdout
    text = (text.replace("TORCH_LIBRARY_FRAGMENT(tokenmill", "TORCH_LIBRARY_FRAGMENT(tmold")
            .replace("TORCH_LIBRARY_IMPL(tokenmill", "TORCH_LIBRARY_IMPL(tmold")
            .replace("namespace tokenmill_native", "namespace tmold_native"))
    (tmp / ("old.cpp" if name.endswith(".cpp") else f"inc/{name}")).write_text(text)
cpp_extension.load(name="prefill_old", sources=[str(tmp / "old.cpp")], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], extra_include_paths=[str(tmp / "inc"), str(CSRC)],
                   is_python_module=False, verbose=False)
assert load_cpu_kernels()
old, new = torch.ops.tmold.prefill_attention, torch.ops.tokenmill.prefill_attention
torch.set_num_threads(2)
g = torch.Generator().manual_seed(1)
for rows, ctx in [(2048, 0), (1024, 0), (256, 0), (2048, 2048)]:
    q = torch.randn(rows, 9, 64, generator=g).bfloat16()
    k = torch.randn(rows + ctx, 3, 64, generator=g).bfloat16()
    v = torch.randn(rows + ctx, 3, 64, generator=g).bfloat16()
    o1, o2 = torch.empty(rows, 9, 64).bfloat16(), torch.empty(rows, 9, 64).bfloat16()
    old(o1, q, k, v, 0.125, ctx, True, None)
    new(o2, q, k, v, 0.125, ctx, True, None)
    assert torch.equal(o1, o2)
    ratios = []
    for _ in range(40):
        ts = []
        for op, o in ((old, o1), (new, o2)):
            t = time.perf_counter()
            op(o, q, k, v, 0.125, ctx, True, None)
            ts.append(time.perf_counter() - t)
        ratios.append(ts[1] / ts[0])
    q1, med, q3 = statistics.quantiles(ratios)
    print(f"{rows} rows after {ctx}: new/old median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)
