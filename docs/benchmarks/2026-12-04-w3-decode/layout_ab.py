"""One build of paged_attention.cpp (2ad0913 or later: it reads a KV head by the cache's head stride) over the two
block layouts: token-major [N, 16, Hkv, D] (the cache's) and head-major [N, Hkv, 16, D] (given to the kernel as the
permuted view of that memory). 30 layers of SmolLM2's shape, alternated, best of 7 (ms); outputs checked equal.

    cp tokenmill/kernels/csrc/paged_attention.cpp /tmp/pa_lay.cpp   (renamed as ../2026-12-02-kernels says)
    [KVD=float8_e4m3fn] python docs/benchmarks/2026-12-04-w3-decode/layout_ab.py
"""
import json
import os
import time

import torch
from torch.utils import cpp_extension

CSRC = os.path.join(os.path.dirname(__file__), "../../../tokenmill/kernels/csrc")
cpp_extension.load(name="pa_lay", sources=["/tmp/pa_lay.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], extra_include_paths=[CSRC], is_python_module=False, verbose=False)
torch.set_num_threads(2)
torch.manual_seed(0)
KVD = getattr(torch, os.environ.get("KVD", "bfloat16"))
L, hkv, hq, d, bs = 30, 3, 9, 64, 16
f = torch.ops.pa_lay.paged_attention


def case(batch, seq, scatter):
    nblk = batch * ((seq + 15) // 16)
    tok = [tuple(torch.randn(nblk, bs, hkv, d).bfloat16().to(KVD) for _ in "kv") for _ in range(L)]
    head = [tuple(x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for x in kv) for kv in tok]
    ids = torch.randperm(nblk) if scatter else torch.arange(nblk)
    bt = ids.view(batch, -1).int()
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    return {"tok": tok, "head": head}, bt, sl, qsl, rows, q

res = {}
for batch, seq, sc in ((1, 256, False), (1, 1024, True), (128, 320, False), (128, 320, True)):
    lay, bt, sl, qsl, rows, q = case(batch, seq, sc)
    outs = {}
    for n, kv in lay.items():
        out = torch.empty(batch, hq, d).bfloat16()
        f(out, q[0], kv[0][0], kv[0][1], bt, sl, qsl, rows, 0.125)
        outs[n] = out
    assert torch.equal(outs["tok"], outs["head"])
    key = f"b{batch}s{seq}{'x' if sc else ''}"
    for _ in range(7):
        for n, kv in lay.items():
            out = torch.empty(batch, hq, d).bfloat16()
            t = time.perf_counter()
            for i in range(L):
                f(out, q[i], kv[i][0], kv[i][1], bt, sl, qsl, rows, 0.125)
            ms = (time.perf_counter() - t) * 1e3
            res[f"{key}/{n}"] = round(min(res.get(f"{key}/{n}", 1e9), ms), 3)
    print(json.dumps({k: v for k, v in res.items() if k.startswith(key)}), flush=True)
