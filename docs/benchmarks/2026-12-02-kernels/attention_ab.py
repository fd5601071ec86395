"""Decode attention of two builds of paged_attention.cpp side by side in one process (30 layers of SmolLM2's
shape: 3 KV heads, 9 query heads, d 64, 16-token blocks), each case alternated 5 times, best kept.

    git show 2bd4425:tokenmill/kernels/csrc/paged_attention.cpp > /tmp/pa_old.cpp   # gathers
    cp tokenmill/kernels/csrc/paged_attention.cpp /tmp/pa_new.cpp
    for n in pa_old pa_new; do sed -i "s/TORCH_LIBRARY_FRAGMENT(tokenmill/TORCH_LIBRARY_FRAGMENT($n/;
        s/TORCH_LIBRARY_IMPL(tokenmill/TORCH_LIBRARY_IMPL($n/; s/namespace tokenmill_native/namespace ${n}_native/" \
        /tmp/$n.cpp; done
    [KVD=float8_e4m3fn] python docs/benchmarks/2026-12-02-kernels/attention_ab.py pa_old,pa_new

Cases: batch 1 at 256 and 1,024 tokens (blocks in order), batch 1 at 256 with scattered blocks, 128 sequences of
320 tokens scattered (a W1 step). Prints the best ms of the 30 layers for each.
"""
import json
import os
import sys
import time

import torch
from torch.utils import cpp_extension

CSRC = os.path.join(os.path.dirname(__file__), "../../../tokenmill/kernels/csrc")   # the headers it includes


def load(name: str, src: str) -> None:
    cpp_extension.load(name=name, sources=[src], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[CSRC], is_python_module=False,
                       verbose=False)


names = sys.argv[1].split(",")
for n in names:
    load(n, f"/tmp/{n}.cpp")
torch.set_num_threads(2)
torch.manual_seed(0)
KVD = getattr(torch, os.environ.get("KVD", "bfloat16"))
L, hkv, hq, d, bs = 30, 3, 9, 64, 16


def case(batch, seq, scatter):
    nblk = batch * ((seq + 15) // 16)
    kc = [torch.randn(nblk, bs, hkv, d).bfloat16().to(KVD) for _ in range(L)]
    vc = [torch.randn(nblk, bs, hkv, d).bfloat16().to(KVD) for _ in range(L)]
    ids = torch.randperm(nblk) if scatter else torch.arange(nblk)
    bt = ids.view(batch, -1).int()
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    return kc, vc, bt, sl, qsl, rows, q


res = {}
for batch, seq, sc in ((1, 256, False), (1, 1024, False), (1, 256, True), (128, 320, True)):
    kc, vc, bt, sl, qsl, rows, q = case(batch, seq, sc)
    outs = {}
    for n in names:
        f = getattr(torch.ops, n).paged_attention
        out = torch.empty(batch, hq, d).bfloat16()
        f(out, q[0], kc[0], vc[0], bt, sl, qsl, rows, 0.125)
        outs[n] = out
    for n in names:
        assert (outs[n].float() - outs[names[0]].float()).abs().max() < 2e-2, n
    key = f"b{batch}s{seq}{'x' if sc else ''}"
    for _ in range(5):
        for n in names:
            f = getattr(torch.ops, n).paged_attention
            out = torch.empty(batch, hq, d).bfloat16()
            t = time.perf_counter()
            for i in range(L):
                f(out, q[i], kc[i], vc[i], bt, sl, qsl, rows, 0.125)
            ms = (time.perf_counter() - t) * 1e3
            res[f"{key}/{n}"] = round(min(res.get(f"{key}/{n}", 1e9), ms), 3)
    print(json.dumps({k: v for k, v in res.items() if k.startswith(key)}), flush=True)
