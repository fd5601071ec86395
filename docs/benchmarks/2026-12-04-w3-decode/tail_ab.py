"""W3's decode tail: 64 sequences of SEQ (default 1,088) tokens whose first 64 blocks (the shared prefix) are
attended elsewhere (start_block = 64), so the paged kernel walks only each sequence's own blocks, scattered in a
pool of 6,000; 30 layers, with log-sum-exps, builds of paged_attention.cpp side by side (best of 15, ms).

    git show 2ad0913~1:tokenmill/kernels/csrc/paged_attention.cpp > /tmp/pa_old.cpp
    cp tokenmill/kernels/csrc/paged_attention.cpp /tmp/pa_new.cpp
    (rename each copy's library and namespace as ../2026-12-02-kernels/attention_ab.py shows)
    SEQ=1088 python docs/benchmarks/2026-12-04-w3-decode/tail_ab.py pa_old,pa_new
"""
import json
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
L, hkv, hq, d, bs = 30, 3, 9, 64, 16
pool = 6000
batch, seq, start = 64, int(os.environ.get("SEQ", 1088)), 64
nb = (seq + 15) // 16
kc = [torch.randn(pool, bs, hkv, d).bfloat16() for _ in range(L)]
vc = [torch.randn(pool, bs, hkv, d).bfloat16() for _ in range(L)]
prefix = torch.arange(start)
tails = torch.randperm(pool - start)[: batch * (nb - start)].view(batch, -1) + start
bt = torch.cat([prefix.expand(batch, -1), tails], 1).int().contiguous()
sl = torch.full((batch,), seq, dtype=torch.int32)
qsl = torch.arange(batch + 1, dtype=torch.int32)
rows = torch.arange(batch)
q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
res = {}
outs = {}
for n in names:
    f = getattr(torch.ops, n).paged_attention
    out, lse = torch.empty(batch, hq, d).bfloat16(), torch.empty(batch, hq)
    f(out, q[0], kc[0], vc[0], bt, sl, qsl, rows, 0.125, start, lse)
    outs[n] = (out, lse)
for n in names:
    assert torch.equal(outs[n][0], outs[names[0]][0]), n
for _ in range(15):
    for n in names:
        f = getattr(torch.ops, n).paged_attention
        out, lse = torch.empty(batch, hq, d).bfloat16(), torch.empty(batch, hq)
        t = time.perf_counter()
        for i in range(L):
            f(out, q[i], kc[i], vc[i], bt, sl, qsl, rows, 0.125, start, lse)
        ms = (time.perf_counter() - t) * 1e3
        res[n] = round(min(res.get(n, 1e9), ms), 3)
print(json.dumps(res))
