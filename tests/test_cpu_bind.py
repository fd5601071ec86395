"""--cpu-bind: CPU lists parse or fail naming the flag; binding pins one thread per listed CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.config import EngineArgs
from tokenmill.platform import one_cpu_per_core, parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("1") == [1]
    for bad in ("x", "", "0,0", "2-a"):
        with pytest.raises(ValueError, match="cpu_bind"):
            parse_cpu_list(bad)


def test_bad_cpu_bind_is_a_clear_error():
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineArgs(cpu_bind="all").create_engine_config()


def test_one_cpu_per_core_is_an_ordered_subset():
    cpus = sorted(os.sched_getaffinity(0))
    chosen = one_cpu_per_core(cpus)
    assert chosen and chosen == sorted(chosen) and set(chosen) <= set(cpus)
    assert one_cpu_per_core(chosen) == chosen  # one per core already: nothing more to drop


def test_bind_threads_pins_each_thread():
    """In a child process, so this test process keeps its own threads."""
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, torch; from tokenmill.platform import bind_cpu_threads; "
            f"line = bind_cpu_threads('{cpu}'); "
            "print(line, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if "not pinned" in out.stdout:
        pytest.skip("the native kernels are unavailable")
    assert out.stdout.strip().endswith(f"1 [{cpu}]"), out.stdout


def test_a_second_engine_in_the_process_gets_every_core():
    """Binding pins the calling thread: a second bind (a second LLM in the same process) must still see the
    process's CPUs, not the one its main thread was pinned to."""
    code = ("import torch; from tokenmill.platform import bind_cpu_threads; "
            "a = bind_cpu_threads('auto'); n = torch.get_num_threads(); b = bind_cpu_threads('auto'); "
            "print(a == b, n, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    same, first, second = out.stdout.split()
    assert same == "True" and first == second, out.stdout
