"""Builds and loads the native CPU attention kernel (csrc/paged_attention.cpp) as a torch op.

`make setup` builds it once (`python -m tokenmill.attention.cpu_ext`); later loads reuse the build, keyed by
the source and the torch version. Without a compiler the CPU backend falls back to the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

from tokenmill.utils import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_dir() -> Path:
    import torch

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + torch.__version__.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "ext"
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def load_cpu_extension(verbose: bool = False) -> bool:
    """True when `torch.ops.tokenmill.paged_attention` is available (building it first if needed)."""
    import torch
    from torch.utils import cpp_extension

    try:
        t0 = time.perf_counter()
        cpp_extension.load(name="tokenmill_cpu_attention", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), is_python_module=False,
                           verbose=verbose)
        elapsed = time.perf_counter() - t0
        if elapsed > 2:
            logger.info("built the native CPU attention kernel in %.1f s", elapsed)
        return hasattr(torch.ops.tokenmill, "paged_attention")
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("native CPU attention kernel unavailable (%s); using the torch path", str(e).splitlines()[0])
        return False


if __name__ == "__main__":
    ok = load_cpu_extension(verbose=False)
    print("native CPU attention kernel:", "ready" if ok else "unavailable (the torch path will be used)")
