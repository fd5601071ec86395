"""Which CPU kernels an engine runs: the instruction set detected at run time, or the one `--cpu-isa` names.

    amx      AMX tiles for prompt-sized matmuls and attention, AVX-512 BF16 / VNNI for the rest (the native build)
    avx512   the native build's AVX-512 BF16 / VNNI kernels with AMX left off
    avx2     the portable kernels on AVX2 + FMA + F16C (bf16 stored, fp32 computed; maddubs for int8/int4): the
             native build on a CPU without AVX-512 BF16, or the AVX2-only build (`torch.ops.tokenmill_avx2`) on one
             that has it, so this path is run, tested and benchmarked on an AVX-512 machine too
    neon     the portable kernels on ARM NEON (+dotprod), the native build of an aarch64 machine
    none     no native kernels: torch's operators (the reference path)

Naming an instruction set the CPU lacks is an error, not a silent fallback. No torch here: the API process
checks the flag and picks the dtype without importing it.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from tokenmill.config import CPU_ISAS

BF16_ISAS = ("amx", "avx512", "avx2", "neon")   # the sets whose kernels store bf16 (and compute in fp32 or bf16)


# The torch.ops namespace of each build of the kernels (kernels/build.py's BUILDS).
NAMESPACES = {"native": "tokenmill", "avx2": "tokenmill_avx2"}


@dataclass(frozen=True)
class KernelSet:
    """The kernels an engine runs: the instruction set, the build they come from (a key of NAMESPACES; None for
    torch's operators) and whether the AMX paths may run."""

    isa: str
    build: str | None
    amx: bool = False

    @property
    def namespace(self) -> str | None:
        return NAMESPACES[self.build] if self.build else None


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


def _is_arm(machine: str) -> bool:
    return machine.lower() in ("aarch64", "arm64")


def detect_isa(flags: frozenset[str], machine: str) -> str:
    """The best instruction set of this CPU that a kernel set exists for."""
    if _is_arm(machine):
        return "neon"
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx"
    if {"avx512_bf16", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c", "bmi2"} <= flags:
        return "avx2"
    return "none"


_RANK = {"none": 0, "avx2": 1, "avx512": 2, "amx": 3}


def resolve_cpu_isa(requested: str, flags: frozenset[str] | None = None, machine: str | None = None) -> KernelSet:
    """The kernel set for `requested` (one of CPU_ISAS) on this CPU; a ValueError naming cpu_isa where the CPU
    cannot run it."""
    if requested not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}; got {requested!r}")
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    best = detect_isa(flags, machine)
    isa = best if requested == "auto" else requested
    if isa == "none":
        return KernelSet("none", None)
    if isa == "neon" or best == "neon":
        if best != isa:
            raise ValueError(f"cpu_isa {requested}: this {'ARM' if best == 'neon' else 'x86'} CPU runs "
                             f"{best} kernels, not {isa}")
        return KernelSet("neon", "native")
    if _RANK[isa] > _RANK[best]:
        raise ValueError(f"cpu_isa {requested}: this CPU lacks it (the best it runs is {best}; flags from "
                         f"/proc/cpuinfo)")
    if isa == "avx2":
        # the native build of an AVX-512 BF16 CPU holds the AVX-512 kernels, not the portable ones
        return KernelSet("avx2", "avx2" if best in ("amx", "avx512") else "native")
    return KernelSet(isa, "native", amx=isa == "amx")
