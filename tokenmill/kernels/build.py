"""Builds and loads tokenmill's native CPU kernels (csrc/*.cpp) as one library of `torch.ops.tokenmill` ops.

`make setup` builds it once (`python -m tokenmill.kernels.build`); later loads reuse the build, keyed by the
sources, the flags and the torch version. Without a compiler every caller falls back to its torch path.

A build folder whose library is there is loaded as it is, without asking ninja: its name is a hash of every
input, so nothing can be stale, while ninja's check goes by modification times (a checkout or a sync that
touches the sources without changing them cost a full two-minute rebuild at a server's start) and takes ~0.25 s.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

from tokenmill.utils import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_NAME = "tokenmill_cpu_kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _build_dir() -> Path:
    import torch

    key = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        key.update(src.name.encode() + src.read_bytes())
    key.update(" ".join(_FLAGS).encode() + torch.__version__.encode())
    key.update(_cpu_flags().encode())  # -march=native: a build is only good for the CPU it was made on
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "ext"
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def load_cpu_kernels(verbose: bool = False) -> bool:
    """True when the `torch.ops.tokenmill` kernels are available (building them first if needed)."""
    import torch
    from torch.utils import cpp_extension

    built = _build_dir() / f"{_NAME}.so"
    if built.exists():
        try:
            torch.ops.load_library(str(built))
            return hasattr(torch.ops.tokenmill, "paged_attention")
        except OSError as e:   # a partial or broken file: build it again
            logger.warning("could not load %s (%s); building the kernels again", built, e)
    try:
        t0 = time.perf_counter()
        cpp_extension.load(name=_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), is_python_module=False,
                           verbose=verbose)
        elapsed = time.perf_counter() - t0
        if elapsed > 2:
            logger.info("built the native CPU kernels in %.1f s", elapsed)
        return hasattr(torch.ops.tokenmill, "paged_attention")
    except Exception as e:  # no compiler, no ninja, a build error: the torch paths still work
        logger.warning("native CPU kernels unavailable (%s); using the torch paths", str(e).splitlines()[0])
        return False


if __name__ == "__main__":
    ok = load_cpu_kernels(verbose=False)
    print("native CPU kernels:", "ready" if ok else "unavailable (the torch paths will be used)")
