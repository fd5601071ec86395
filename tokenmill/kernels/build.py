"""Builds and loads tokenmill's native CPU kernels (csrc/*.cpp) as one library of `torch.ops.tokenmill` ops.

`make setup` builds it once (`python -m tokenmill.kernels.build`); later loads reuse the build, keyed by the
sources, the flags and the torch version. Without a compiler every caller falls back to its torch path.

Two builds come from the same sources (see BUILDS): the native one (-march=native: whatever this CPU has,
registered as `torch.ops.tokenmill`) and an AVX2-only one (`torch.ops.tokenmill_avx2`), which `--cpu-isa avx2`
loads on a CPU that has more, so the AVX2 kernels are run, tested and benchmarked on an AVX-512 machine too.
Each source guards its kernels by the instruction sets the compiler was given, so a build holds what its flags
allow: the AVX-512 kernels, or the portable ones (portable_ops.cpp: AVX2 or ARM NEON).

A build folder whose library is there is loaded as it is, without asking ninja: its name is a hash of every
input, so nothing can be stale, while ninja's check goes by modification times (a checkout or a sync that
touches the sources without changing them cost a full two-minute rebuild at a server's start) and takes ~0.25 s.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.cpu_isa import NAMESPACES
from tokenmill.utils import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))

@dataclass(frozen=True)
class KernelBuild:
    """One library of the kernels: its compiler flags and the op namespace it registers."""

    name: str
    namespace: str
    flags: tuple[str, ...]
    sources: tuple[str, ...] | None = None  # file names under csrc/; None: all of them

    def source_paths(self) -> list[Path]:
        return [s for s in _SOURCES if self.sources is None or s.name in self.sources]


# -Wl,-Bsymbolic: each library's calls between its own kernels stay inside it, whichever loaded first.
BUILDS = {
    "native": KernelBuild("tokenmill_cpu_kernels", NAMESPACES["native"], ("-O3", "-march=native", "-fopenmp")),
    "avx2": KernelBuild("tokenmill_avx2_kernels", NAMESPACES["avx2"],
                        ("-O3", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-fopenmp", "-DTM_NS=tokenmill_avx2"),
                        # the files with kernels an AVX2 build compiles (the others are AVX-512 only): a third of
                        # the native build's time
                        ("portable_ops.cpp", "decoder_stack.cpp", "paged_attention.cpp", "merge_attn.cpp",
                         "threads.cpp", "token_bitmask.cpp")),
}


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _build_dir(build: KernelBuild) -> Path:
    import torch

    key = hashlib.sha256()
    for src in build.source_paths() + _HEADERS:
        key.update(src.name.encode() + src.read_bytes())
    key.update(" ".join(build.flags).encode() + torch.__version__.encode())
    key.update(_cpu_flags().encode())  # -march=native: a build is only good for the CPU it was made on
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "ext"
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load_cpu_kernels(verbose: bool = False, variant: str = "native") -> bool:
    """True when the kernels of `variant` (a key of BUILDS; the native build by default, as
    `torch.ops.tokenmill`) are available, building them first if needed."""
    import torch
    from torch.utils import cpp_extension

    build = BUILDS[variant]
    built = _build_dir(build) / f"{build.name}.so"
    if built.exists():
        try:
            torch.ops.load_library(str(built))
            return hasattr(getattr(torch.ops, build.namespace), "paged_attention")
        except OSError as e:   # a partial or broken file: build it again
            logger.warning("could not load %s (%s); building the kernels again", built, e)
    try:
        t0 = time.perf_counter()
        cpp_extension.load(name=build.name, sources=[str(s) for s in build.source_paths()],
                           extra_cflags=list(build.flags), extra_ldflags=["-fopenmp", "-Wl,-Bsymbolic"],
                           build_directory=str(_build_dir(build)), is_python_module=False, verbose=verbose)
        elapsed = time.perf_counter() - t0
        if elapsed > 2:
            logger.info("built the %s CPU kernels in %.1f s", variant, elapsed)
        return hasattr(getattr(torch.ops, build.namespace), "paged_attention")
    except Exception as e:  # no compiler, no ninja, a build error: the torch paths still work
        logger.warning("%s CPU kernels unavailable (%s); using the torch paths", variant, str(e).splitlines()[0])
        return False


def _x86_avx2() -> bool:
    flags = _cpu_flags().split()
    return all(f in flags for f in ("avx2", "fma", "f16c", "bmi2"))


if __name__ == "__main__":
    ok = load_cpu_kernels(verbose=False)
    print("native CPU kernels:", "ready" if ok else "unavailable (the torch paths will be used)")
    if "avx512f" in _cpu_flags().split() and _x86_avx2():   # what --cpu-isa avx2 loads on this CPU
        ok = load_cpu_kernels(verbose=False, variant="avx2")
        print("AVX2-only CPU kernels:", "ready" if ok else "unavailable (--cpu-isa avx2 will refuse)")
