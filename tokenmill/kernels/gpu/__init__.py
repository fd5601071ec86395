"""GPU kernels written in Triton: paged decode attention and the int8/int4 weight matmul.

They run on a CUDA device, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which is how the
test suite checks them on a machine without a GPU. Triton is optional: `available()` says whether they can run.
"""

from __future__ import annotations

import functools
import os

QUANT_BLOCK_K = 32   # the quantized matmul's inputs a tile (quant_matmul.py): groups must be multiples of it


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Triton runs its kernels in Python on the host (CPU tensors): the test suite's way without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: str) -> bool:
    """Whether the Triton kernels can run on tensors of `device` ("cuda", or "cpu" under the interpreter)."""
    if not triton_installed():
        return False
    return device == "cuda" or (device == "cpu" and interpreted())
