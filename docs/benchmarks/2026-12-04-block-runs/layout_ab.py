"""Decode attention (the native paged_attention, 30 layers of SmolLM2's shape, 128 requests x 320 tokens of
context, best of 7 alternated) over five placements of the same blocks, bf16 and fp8 caches: all in order,
each request's blocks one ascending run (requests anywhere), one descending run, a fresh W1's placement under the
older pool (each prompt's 16 blocks in order, the 4 decoded ones scattered), and every block scattered.

    python layout_ab.py
"""
import time

import torch

from tokenmill.kernels.build import load_cpu_kernels

load_cpu_kernels()
torch.set_num_threads(2)
torch.manual_seed(0)
L, d, bs, hkv, hq = 30, 64, 16, 3, 9
batch, seq = 128, 320
nb = seq // bs
nblk = batch * nb + 1


def layout(kind: str) -> torch.Tensor:
    if kind == "in_order":
        return torch.arange(1, nblk).view(batch, nb)
    if kind == "scattered":
        return (torch.randperm(nblk - 1) + 1).view(batch, nb)
    if kind == "per_request_runs":
        return (torch.randperm(batch) * nb + 1)[:, None] + torch.arange(nb)[None]
    if kind == "per_request_desc":
        return (torch.randperm(batch) * nb + nb)[:, None] - torch.arange(nb)[None]
    if kind == "w1_like":   # a fresh W1 under the old pool: prompts' 16 blocks in order, decoded ones scattered
        prompt = torch.arange(batch * 16).view(batch, 16) + 1
        return torch.cat([prompt, (torch.randperm(batch * 4) + 1 + batch * 16).view(batch, 4)], 1)
    raise ValueError(kind)


kinds = ["in_order", "per_request_runs", "per_request_desc", "w1_like", "scattered"]
for kvd in (torch.bfloat16, torch.float8_e4m3fn):
    kc = [torch.randn(nblk, bs, hkv, d).to(kvd) for _ in range(L)]
    vc = [torch.randn(nblk, bs, hkv, d).to(kvd) for _ in range(L)]
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    tables = {k: layout(k).int().contiguous() for k in kinds}
    best = {k: 1e9 for k in kinds}
    out = torch.empty(batch, hq, d).bfloat16()
    for _ in range(7):
        for k in kinds:
            t = time.perf_counter()
            for i in range(L):
                torch.ops.tokenmill.paged_attention(out, q[i], kc[i], vc[i], tables[k], sl, qsl, rows, 0.125)
            best[k] = min(best[k], time.perf_counter() - t)
    print(kvd, "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()), flush=True)
