"""add_rms_norm (and rms_norm) on SmolLM2's 576-wide rows, hot in cache: best of 2,000 calls per batch size.

    python norm_mb.py
"""
import time, torch
from tokenmill.kernels.build import load_cpu_kernels
load_cpu_kernels()
op = torch.ops.tokenmill.add_rms_norm
for rows in (1, 16, 64, 128, 256):
    x = torch.randn(rows, 576).bfloat16(); r = torch.randn(rows, 576).bfloat16(); w = torch.randn(576).bfloat16()
    best = 1e9
    for i in range(2000):
        t = time.perf_counter(); op(x, r, w, 1e-5); best = min(best, time.perf_counter() - t)
    print(rows, f"{best*1e6:.1f} us")
op2 = torch.ops.tokenmill.rms_norm
for rows in (128,):
    x = torch.randn(rows, 576).bfloat16(); o = torch.empty_like(x); w = torch.randn(576).bfloat16()
    best = 1e9
    for i in range(2000):
        t = time.perf_counter(); op2(o, x, w, 1e-5); best = min(best, time.perf_counter() - t)
    print("rms_norm only", rows, f"{best*1e6:.1f} us")
