"""The first write of fresh memory in this VM, a GiB at a time: run it twice in a row and compare (the second
process gets back pages the first freed only until the balloon has reported them to the host).

    python first_writes.py [GIB]      (default 6)
"""
import sys
import time

import torch

bufs = []
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    b = torch.empty(1 << 30, dtype=torch.uint8)
    t = time.perf_counter()
    b.fill_(1)
    print(f"GiB {i}: {(1 << 30) / (time.perf_counter() - t) / 1e9:.2f} GB/s", flush=True)
    bufs.append(b)
