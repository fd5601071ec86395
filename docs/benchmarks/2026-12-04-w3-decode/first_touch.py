"""The first write to a fresh anonymous mapping in 6 KB rows (a KV block of SmolLM2's one layer), 128 rows a call
as index_copy_ (a step's new blocks), in random or in id order, in 4 KiB pages or with MADV_HUGEPAGE. Run each in a
fresh process: how fast a page is first written depends on whether the guest still has it backed.

    python docs/benchmarks/2026-12-04-w3-decode/first_touch.py 4k|thp random|seq
"""
import mmap
import sys
import time

import torch

torch.set_num_threads(2)
mode, order = sys.argv[1], sys.argv[2]
size = 6144 * 160000
mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if mode == "thp":
    mm.madvise(mmap.MADV_HUGEPAGE)
rows = torch.frombuffer(mm, dtype=torch.uint8).view(-1, 6144)
n = rows.shape[0]
order_ids = torch.randperm(n) if order == "random" else torch.arange(n)
src = torch.ones(128, 6144, dtype=torch.uint8)
t0 = time.perf_counter()
for i in range(0, n, 128):
    idx = order_ids[i:i + 128]
    rows.index_copy_(0, idx, src[: len(idx)])
print(mode, order, f"{size / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
