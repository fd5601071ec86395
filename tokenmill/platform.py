"""Device and dtype defaults: one of the two places where CPU and CUDA differ (the other is attention/)."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_runs_bf16_well() -> bool:
    """bf16 matmuls only pay off on CPUs with native bf16 dot products (AVX512-BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str) -> torch.dtype:
    if device == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_runs_bf16_well() else torch.float32


def runs_well(dtype: torch.dtype, device: str) -> bool:
    if device == "cuda" or dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_runs_bf16_well()


def available_memory_bytes() -> int:
    """Free memory on the device the KV cache lives on."""
    if device_type() == "cuda":
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


def num_physical_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
