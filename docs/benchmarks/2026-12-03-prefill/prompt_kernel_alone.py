"""One layer of SmolLM2's prompt attention (9 query heads, 3 KV heads, head_dim 64, causal), the native prompt
kernel against torch's SDPA (on CPUs without AMX: bf16 turned into fp32 for MKL), alternated; GFLOP/s of the
causal work (4 x heads x d x (rows x context + rows^2 / 2)).

    python docs/benchmarks/2026-12-03-prefill/prompt_kernel_alone.py [rows:context,...]
"""
import sys
import time

import torch
import torch.nn.functional as F

import tokenmill.kernels as kernels

op = kernels.prefill_attention_op()
cases = [tuple(map(int, c.split(":"))) for c in (sys.argv[1] if len(sys.argv) > 1 else
                                                  "256:0,1024:0,2048:0,2048:5888,512:7424").split(",")]
g = torch.Generator().manual_seed(1)


def rate(f, flop: float) -> int:
    """GFLOP/s of f, timed over enough calls for ~10 GFLOP of work."""
    n = max(2, int(1e10 / flop))
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return round(flop / ((time.perf_counter() - t) / n) / 1e9)


for rows, ctx in cases:
    qkv = torch.randn(ctx + rows, 960, generator=g).bfloat16()
    k, v = qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)
    q = qkv[ctx:, :576].view(-1, 9, 64)
    out = torch.empty(rows, 9, 64, dtype=torch.bfloat16)
    mask = torch.arange(ctx + rows)[None, :] <= torch.arange(ctx, ctx + rows)[:, None]
    heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
    calls = {"native": lambda q=q, k=k, v=v, out=out, ctx=ctx: op(out, q, k, v, 0.125, ctx),
             "sdpa": lambda heads=heads, mask=mask, ctx=ctx: F.scaled_dot_product_attention(
                 *heads, attn_mask=None if ctx == 0 else mask, is_causal=ctx == 0, scale=0.125, enable_gqa=True)}
    flop = 4 * 9 * 64 * (rows * ctx + rows * rows / 2)
    rates = {name: [rate(f, flop) for _ in range(2)] for name, f in calls.items()}
    print(f"{rows} rows after {ctx}: GFLOP/s native {rates['native']}  sdpa {rates['sdpa']}", flush=True)
