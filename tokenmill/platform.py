"""Device and dtype defaults: one of the two places where CPU and CUDA differ (the other is attention/)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from tokenmill.cpu_isa import BF16_ISAS, resolve_cpu_isa


@functools.lru_cache(maxsize=1)
def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build (its version ends in +cpu, as the pinned wheel's does)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def device_type() -> str:
    """The device the engine runs on: cuda where torch sees a GPU. A CPU-only torch build answers without
    importing torch, which the API server otherwise never needs (importing it is 2-3 s of a cold start)."""
    if "torch" not in sys.modules and _cpu_only_torch():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_runs_bf16_well(cpu_isa: str = "auto") -> bool:
    """bf16 pays off where the selected CPU kernels store it: with native bf16 dot products (AVX512-BF16, AMX),
    and on AVX2 or NEON, whose kernels read bf16 (half fp32's bytes: decode reads every weight once a token)
    and compute in fp32. torch's own operators (--cpu-isa none) are faster in fp32 there."""
    try:
        return resolve_cpu_isa(cpu_isa).isa in BF16_ISAS
    except ValueError:   # a set this CPU lacks: create_config says so
        return False


def default_dtype(device: str, cpu_isa: str = "auto") -> str:
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_runs_bf16_well(cpu_isa) else "float32"


def runs_well(dtype: str, device: str, cpu_isa: str = "auto") -> bool:
    if device == "cuda" or dtype == "float32":
        return True
    return dtype == "bfloat16" and cpu_runs_bf16_well(cpu_isa)


def available_memory_bytes() -> int:
    """Free memory on the device the KV cache lives on."""
    if device_type() == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def one_cpu_per_core(cpus: list[int]) -> list[int]:
    """The first logical CPU of each physical core among `cpus` (hyper-threads share a core's matmul units)."""
    seen: set[tuple[str, str]] = set()
    chosen = []
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                core = (f1.read().strip(), f2.read().strip())
        except OSError:
            core = ("cpu", str(cpu))
        if core not in seen:
            seen.add(core)
            chosen.append(cpu)
    return chosen


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; a ValueError names --cpu-bind when the text is not such a list."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"cpu_bind must be 'auto', 'none' or a CPU list like '0-3,6', got {text!r}") from None
    if not cpus or len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_bind lists no CPU or a CPU twice: {text!r}")
    return cpus


_process_cpus: list[int] | None = None


def process_cpus() -> list[int]:
    """The CPUs this process may use, as they were before an engine bound its threads: binding pins the calling
    thread to one CPU, so asking the thread again would make a second engine in the process single-threaded."""
    global _process_cpus
    if _process_cpus is None:
        _process_cpus = allowed_cpus()
    return _process_cpus


def engine_cpus(cpu_bind: str) -> list[int]:
    """The CPUs `cpu_bind` gives the engine (all of its ranks together)."""
    cpus = one_cpu_per_core(process_cpus()) if cpu_bind in ("auto", "none") else parse_cpu_list(cpu_bind)
    allowed = set(process_cpus())
    if not set(cpus) <= allowed:
        raise ValueError(f"cpu_bind {cpu_bind!r} names CPUs outside this process's set {sorted(allowed)}")
    return cpus


def rank_cpus(cpus: list[int], rank: int, world_size: int) -> list[int]:
    """A rank's contiguous share of the engine's CPUs (ranks share CPUs only when there are fewer CPUs than ranks)."""
    if world_size <= 1:
        return cpus
    if len(cpus) < world_size:
        return [cpus[rank % len(cpus)]]
    per, extra = divmod(len(cpus), world_size)
    start = rank * per + min(rank, extra)
    return cpus[start:start + per + (1 if rank < extra else 0)]


def select_cpu_kernels(cpu_isa: str) -> str:
    """Selects the process's CPU kernel set (before the model is built: its layers ask which kernels to use).
    Returns a line for the log."""
    import tokenmill.kernels as kernels

    k = kernels.use_cpu_isa(cpu_isa)
    if kernels.ops() is None:
        return f"{k.isa}: torch's operators" + ("" if k.isa == "none" else " (the native kernels did not build)")
    return f"{k.isa} (torch.ops.{k.namespace}{', AMX on' if k.amx else ''})"


def bind_cpu_threads(cpu_bind: str, cpus: list[int] | None = None) -> str:
    """Sets the engine's intra-op threads: one per physical core, each pinned to its own CPU (or, with 'none',
    unpinned); `cpus` is a rank's share when the engine has several. Returns a line for the log."""
    import torch

    if cpus is None:
        cpus = engine_cpus(cpu_bind)
    if cpu_bind == "none":
        torch.set_num_threads(len(cpus))
        return f"{len(cpus)} threads, not pinned"
    from tokenmill.kernels.build import load_cpu_kernels

    if not load_cpu_kernels():
        torch.set_num_threads(len(cpus))
        return f"{len(cpus)} threads, not pinned (the native kernels are unavailable)"
    torch.ops.tokenmill.bind_threads(cpus)   # the native build's (every build pins threads alike)
    return f"{len(cpus)} threads pinned to CPUs {','.join(map(str, cpus))}"


def engine_host_cpus(cpu_bind: str, world_size: int) -> tuple[list[int], list[int]]:
    """The CPUs an engine's threads are pinned to, and among them the CPU of each rank's first intra-op thread,
    which also runs the rank's Python between forwards (scheduling, inputs, outputs); none where the threads
    are not pinned."""
    if cpu_bind == "none":
        return [], []
    cpus = engine_cpus(cpu_bind)
    return cpus, sorted({rank_cpus(cpus, r, world_size)[0] for r in range(world_size)})


def side_cpus(engine: list[int], hosts: list[int]) -> list[int] | None:
    """Where a server's front end and the engines' message threads belong: CPUs no engine thread is pinned to
    if there are any, else every CPU but the engines' host CPUs. Their work for each step (~0.6 ms of a
    streamed token at batch 1) then lands beside an intra-op thread that only waits while the host thread
    prepares the next step, not on the host thread's own core: on 2 cores that cut a batch-1 step's time
    between forwards from 0.67-0.89 to 0.38-0.43 ms. None where nothing is pinned or no CPU would be left."""
    if not hosts:
        return None
    engine_set, host_set = set(engine), set(hosts)
    free = [c for c in process_cpus() if c not in engine_set]
    return free or [c for c in process_cpus() if c not in host_set] or None


def pin_process_threads(cpus: list[int]) -> None:
    """Every thread of this process (and so the threads they start) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:   # a thread that has just exited
            pass


# glibc mallopt parameters, and its ceiling on the mmap threshold on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> bool:
    """Makes glibc serve blocks up to 32 MiB from its heap and never give freed heap back to the kernel.

    By default it maps large blocks fresh and returns them on free, so each engine step faults its activations
    (13 MB tensors at a 2,048-token step) in again page by page: W1 took ~640k page faults, ~3 s of 23 on
    this machine. vLLM gets the same effect from tcmalloc. The heap then stays at its peak step's size."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc
        return False
