"""Decode attention (paged_attention) of variants of paged_attention.cpp built under other op names (as
../2026-12-02-kernels/attention_ab.py's docstring says), 30 layers of SmolLM2's shape, best of 7 alternated,
with the rate each reads its KV bytes at.

    python docs/benchmarks/2026-12-03-vnni-stream/attention_variants.py pa_old,pa_new
Environment: CASES='[(batch, tokens, scattered), ...]'; KVD=float8_e4m3fn (cache dtype); HKV=1 (KV heads, 3 query
heads each); HOT=1 (every layer reads layer 0's cache: the kernel's speed from cache); HEADMAJOR=1 (each block's
rows stored head by head, [blocks, heads, 16, 64], passed as a strided view: for a variant that reads the head
stride from the tensor).
"""
import ast
import os
import sys
import time

import torch
from torch.utils import cpp_extension

CSRC = os.path.join(os.path.dirname(__file__), "../../../tokenmill/kernels/csrc")
names = sys.argv[1].split(",")
for n in names:
    cpp_extension.load(name=n, sources=[f"/tmp/{n}.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[CSRC], is_python_module=False, verbose=False)
torch.set_num_threads(2)
torch.manual_seed(0)
L, d, bs = 30, 64, 16
hkv = int(os.environ.get("HKV", 3))
hq = 3 * hkv
KVD = getattr(torch, os.environ.get("KVD", "bfloat16"))
HOT = bool(os.environ.get("HOT"))
cases = ast.literal_eval(os.environ.get("CASES", "[(128, 320, True), (64, 1100, True), (4, 8000, True), "
                                                 "(4, 8000, False), (1, 8000, False), (1, 256, False)]"))


def cache(nblk: int) -> list[torch.Tensor]:
    if os.environ.get("HEADMAJOR"):
        return [torch.randn(nblk, hkv, bs, d).to(KVD).transpose(1, 2) for _ in range(L)]
    return [torch.randn(nblk, bs, hkv, d).to(KVD) for _ in range(L)]


for batch, seq, scattered in cases:
    nblk = batch * ((seq + 15) // 16) + 1
    kc, vc = cache(nblk), cache(nblk)
    ids = (torch.randperm(nblk - 1) + 1) if scattered else torch.arange(1, nblk)
    bt = ids.view(batch, -1).int()
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    best = {n: 1e9 for n in names}
    for _ in range(7):
        for n in names:
            f = getattr(torch.ops, n).paged_attention
            out = torch.empty(batch, hq, d).bfloat16()
            t = time.perf_counter()
            for i in range(L):
                j = 0 if HOT else i
                f(out, q[j], kc[j], vc[j], bt, sl, qsl, rows, 0.125)
            best[n] = min(best[n], time.perf_counter() - t)
    gb = batch * seq * hkv * d * kc[0].element_size() * 2 * L / 1e9
    print(f"{batch} x {seq}{' scattered' if scattered else ''}: "
          + "  ".join(f"{n} {best[n] * 1e3:.2f} ms ({gb / best[n]:.1f} GB/s)" for n in names), flush=True)
