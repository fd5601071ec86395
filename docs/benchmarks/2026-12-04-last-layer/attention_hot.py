"""Decode attention of a W1 step (128 sequences of 320 tokens, 30 layers, SmolLM2's 3 KV heads of 64 and 9 query
heads, 16-token blocks, each sequence's blocks in order) from memory, against the same work over blocks that stay
in L2 (every sequence reads the first one's 20 blocks), and the same bytes with one KV head per block row (384
sequences of 1 KV head and 3 query heads: each head's keys contiguous). Best ms of 9 for each.

    [KVD=float8_e4m3fn] python attention_hot.py
"""
import os
import time

import torch

from tokenmill.kernels.build import load_cpu_kernels

load_cpu_kernels()
torch.set_num_threads(2)
torch.manual_seed(0)
KVD = getattr(torch, os.environ.get("KVD", "bfloat16"))
L, d, bs, seq = 30, 64, 16, 320


def run(batch: int, hkv: int, hot: bool) -> float:
    hq, nblk = 3 * hkv, batch * seq // bs
    kc = [torch.randn(nblk, bs, hkv, d).bfloat16().to(KVD) for _ in range(L)]
    vc = [torch.randn(nblk, bs, hkv, d).bfloat16().to(KVD) for _ in range(L)]
    bt = torch.arange(nblk).view(batch, -1).int()
    if hot:
        bt = bt[:1].repeat(batch, 1).contiguous()
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    out = torch.empty(batch, hq, d).bfloat16()
    best = 1e9
    for _ in range(9):
        t = time.perf_counter()
        for i in range(L):
            torch.ops.tokenmill.paged_attention(out, q[i], kc[i], vc[i], bt, sl, qsl, rows, 0.125)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


for name, args in (("3 KV heads, from memory", (128, 3, False)), ("3 KV heads, hot in L2", (128, 3, True)),
                   ("1 KV head, 3x the sequences", (384, 1, False))):
    print(f"{KVD} {name}: {run(*args):.1f} ms")
