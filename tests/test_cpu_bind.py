"""--cpu-bind: CPU lists parse or fail naming the flag; binding pins one thread per listed CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill.config import EngineArgs
from tokenmill.engine.create_config import create_engine_config
from tokenmill.platform import one_cpu_per_core, parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("1") == [1]
    for bad in ("x", "", "0,0", "2-a"):
        with pytest.raises(ValueError, match="cpu_bind"):
            parse_cpu_list(bad)


def test_bad_cpu_bind_is_a_clear_error():
    with pytest.raises(ValueError, match="cpu_bind"):
        create_engine_config(EngineArgs(cpu_bind="all"))


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


def test_front_end_keeps_off_each_rank_host_cpu(monkeypatch):
    """The server's front end and the engines' message threads take CPUs no engine thread uses if there are any,
    else every CPU but those where an engine rank's first intra-op thread (which also runs its Python) is
    pinned; nothing is moved when nothing is pinned or no CPU would be left."""
    import tokenmill.platform as platform

    monkeypatch.setattr(platform, "_process_cpus", [0, 1, 2, 3])
    assert platform.engine_host_cpus("0-3", 1) == ([0, 1, 2, 3], [0])
    assert platform.engine_host_cpus("0-3", 2) == ([0, 1, 2, 3], [0, 2])   # two ranks: CPUs 0-1 and 2-3
    assert platform.engine_host_cpus("1-2", 1) == ([1, 2], [1])
    assert platform.engine_host_cpus("none", 1) == ([], [])
    assert platform.side_cpus([0, 1, 2, 3], [0]) == [1, 2, 3]
    assert platform.side_cpus([0, 1, 2, 3], [0, 2]) == [1, 3]
    assert platform.side_cpus([1, 2], [1]) == [0, 3]          # CPUs the engine leaves free come first
    assert platform.side_cpus([], []) is None
    assert platform.side_cpus([0, 1, 2, 3], [0, 1, 2, 3]) is None


def _all_cpus() -> None:
    """A child's start: every CPU this machine lets it have (an engine in this test process pins its threads)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass


def test_server_threads_leave_the_engine_host_cpu():
    """The API server's threads (zmq's included) move off the CPU of the engine's host thread once the engine
    has started; in a child process, so this test process keeps its own threads."""
    code = ("import json, os, types, zmq; from tokenmill.config import EngineArgs; "
            "from tokenmill.entrypoints.openai.server import keep_off_engine_host_cpus; "
            "from tokenmill.platform import engine_host_cpus; "
            "ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.bind('inproc://x'); "
            "from tokenmill.engine.create_config import create_engine_config; "
            "config = create_engine_config(EngineArgs()); "
            "keep_off_engine_host_cpus(types.SimpleNamespace(client=types.SimpleNamespace(config=config))); "
            "masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')]; "
            "print(json.dumps([engine_host_cpus('auto', 1), masks]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         preexec_fn=_all_cpus)
    assert out.returncode == 0, out.stderr
    (engine, hosts), masks = json.loads(out.stdout.strip().splitlines()[-1])
    if len(engine) < 2:
        pytest.skip("the engine has one CPU here: nowhere else to go")
    assert hosts and len(masks) >= 3   # the main thread and zmq's two
    assert all(m and set(m).isdisjoint(hosts) for m in masks)
