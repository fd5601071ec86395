"""How fast this guest backs fresh anonymous memory on its first write: 1 GiB per mapping, written once with
memset by N threads, in 4 KiB pages or (madvise MADV_HUGEPAGE) 2 MiB ones, then written again.

    python first_touch.py plain,huge,plain,huge [threads=1]      (a fresh process per call: fresh mappings)
"""
import ctypes
import sys
import threading
import time

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
MADV_HUGEPAGE, HUGE = 14, 2 << 20
n = 1 << 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1


def write(p: int, value: int) -> float:
    """Seconds to memset [p, p + n) with `threads` threads (ctypes lets go of the GIL)."""
    parts = [threading.Thread(target=libc.memset, args=(p + i * n // threads, value, n // threads))
             for i in range(threads)]
    t = time.perf_counter()
    for th in parts:
        th.start()
    for th in parts:
        th.join()
    return time.perf_counter() - t


for mode in sys.argv[1].split(","):
    raw = libc.mmap(None, n + HUGE, 3, 0x22, -1, 0)   # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    p = (raw + HUGE - 1) & ~(HUGE - 1)
    if mode == "huge":
        libc.madvise(p, n, MADV_HUGEPAGE)
    first, second = write(p, 0), write(p, 1)
    print(f"{mode:5} threads {threads}: first write {n / first / 1e9:.2f} GB/s, second {n / second / 1e9:.1f} GB/s",
          flush=True)
    libc.munmap(raw, n + HUGE)
