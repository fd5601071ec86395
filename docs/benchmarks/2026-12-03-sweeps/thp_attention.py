"""Decode attention (the built paged_attention) over 30 layers' KV caches in 4 KiB pages against the same caches
in 2 MiB pages (an anonymous map with madvise(MADV_HUGEPAGE) before its first write), alternated, best and median
of 9; AnonHugePages from /proc/meminfo shows the huge pages are there.

    python docs/benchmarks/2026-12-03-sweeps/thp_attention.py
"""
import mmap
import time

import torch

from tokenmill.kernels.build import load_cpu_kernels

assert load_cpu_kernels()
torch.set_num_threads(2)
torch.manual_seed(0)
L, d, bs, hkv, hq = 30, 64, 16, 3, 9


def alloc(nbytes: int, huge: bool) -> torch.Tensor:
    if not huge:
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    off = (-t.data_ptr()) % (2 << 20)   # start on a 2 MiB boundary
    t = t[off:off + nbytes]
    t._keep = m
    return t


def caches(nblk: int, huge: bool) -> list[torch.Tensor]:
    per = nblk * bs * hkv * d * 2
    out = []
    for _ in range(L):
        c = alloc(2 * per, huge).view(torch.bfloat16).view(2, nblk, bs, hkv, d)
        c.copy_(torch.randn(2, nblk, bs, hkv, d).bfloat16())
        out.append(c)
    return out


def huge_kb() -> int:
    return int(open("/proc/meminfo").read().split("AnonHugePages:")[1].split()[0])


f = torch.ops.tokenmill.paged_attention
for batch, seq in [(128, 320), (64, 1100), (4, 8000)]:
    nblk = batch * ((seq + 15) // 16) + 1
    bt = (torch.randperm(nblk - 1) + 1).view(batch, -1).int()   # scattered blocks
    sl = torch.full((batch,), seq, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    rows = torch.arange(batch)
    q = [torch.randn(batch, hq, d).bfloat16() for _ in range(L)]
    kv = {h: caches(nblk, h) for h in (False, True)}
    print("AnonHugePages kB", huge_kb(), flush=True)
    times = {False: [], True: []}
    for _ in range(9):
        for h in (False, True):
            out = torch.empty(batch, hq, d).bfloat16()
            t = time.perf_counter()
            for i in range(L):
                f(out, q[i], kv[h][i][0], kv[h][i][1], bt, sl, qsl, rows, 0.125)
            times[h].append(time.perf_counter() - t)
    gb = batch * seq * hkv * d * 2 * 2 * L / 1e9
    for h in (False, True):
        s = sorted(times[h])
        print(f"{batch} x {seq} {'2 MiB' if h else '4 KiB'}: best {s[0] * 1e3:.1f} ms, median {s[4] * 1e3:.1f} ms "
              f"({gb / s[0]:.1f} GB/s at best)", flush=True)
