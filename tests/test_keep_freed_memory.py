"""keep_freed_memory: a block freed by one step and allocated again by the next is not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.platform import keep_freed_memory

# Each round allocates, touches and frees 20 MiB through glibc, as an engine step does with its activations;
# it prints the page faults of each round.
_ROUNDS = """
import ctypes, resource, sys
from tokenmill.platform import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "1":
    assert keep_freed_memory()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(20 << 20)
    ctypes.memset(block, 1, 20 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
print(*faults)
"""
PAGES = (20 << 20) // 4096


def _faults_per_round(keep: bool) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, "1" if keep else "0"], capture_output=True, text=True,
                         check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_later_rounds_reuse_freed_memory():
    if not keep_freed_memory():
        pytest.skip("not glibc")
    kept, default = _faults_per_round(True), _faults_per_round(False)
    assert kept[0] > PAGES // 2  # the first round really touches new pages
    assert max(kept[1:]) < PAGES // 20, kept
    assert default[1] > PAGES // 2, default  # glibc's default unmaps the block and faults it in again
