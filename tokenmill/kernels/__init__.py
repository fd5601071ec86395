"""tokenmill's native CPU kernels: paged attention, bf16 matmuls on the AMX tile layout, quantized matmuls and fused
elementwise ops, from the build the process's kernel set names (cpu_isa.py: `--cpu-isa`, detected by default).

Layers ask here once, when they are built, which kernels they may use and take their ops from `ops()`: an
engine selects its set (use_cpu_isa) before it builds its model.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.cpu_isa import CPU_ISAS, KernelSet, resolve_cpu_isa

__all__ = ["CPU_ISAS", "KernelSet", "active", "amx_available", "has_op", "native_kernels_for", "ops",
           "prefill_attention_op", "quant_kernels_available", "use_cpu_isa"]

# The row limit of a native path that takes any batch (the vector tile matmul, or oneDNN past AMX's rows).
ANY_ROWS = 1 << 30

_active: KernelSet | None = None


def use_cpu_isa(requested: str = "auto") -> KernelSet:
    """Selects this process's kernel set (building its library if needed); a ValueError where the CPU cannot
    run it, or where the library will not build for a named instruction set. The last engine to start in a
    process sets it for the layers built after it."""
    global _active
    chosen = resolve_cpu_isa(requested)
    if chosen.build is not None and not _built(chosen.build) and requested != "auto":
        raise ValueError(f"cpu_isa {requested}: its kernels did not build here (a compiler is needed; see the log)")
    _active = chosen
    return chosen


def active() -> KernelSet:
    """The selected kernel set (detected, when no engine has chosen one)."""
    global _active
    if _active is None:
        _active = resolve_cpu_isa("auto")
    return _active


@functools.cache
def _built(build: str) -> bool:
    from tokenmill.kernels.build import load_cpu_kernels  # not at import: `python -m tokenmill.kernels.build`

    return load_cpu_kernels(variant=build)


def ops():
    """The `torch.ops` namespace of the selected kernels; None where they are torch's own (none, or not built)."""
    k = active()
    if k.build is None or not _built(k.build):
        return None
    return getattr(torch.ops, k.namespace)


def has_op(name: str) -> bool:
    namespace = ops()
    return namespace is not None and hasattr(namespace, name)


def native_kernels_for(t: torch.Tensor) -> bool:
    """Whether the native bf16 kernels can take this layer's work: bf16 on the CPU, with the selected set's
    bf16 kernels built (AVX-512 BF16, or the portable AVX2 / NEON ones). fp32 always takes the torch path,
    which is transformers' exact sequence of operations."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and has_op("tiled_skinny_gemm")


def amx_available() -> bool:
    """Whether the AMX matmul can run: selected, kernels built with AMX, the CPU has it, and Linux grants its
    state."""
    return active().amx and has_op("tiled_skinny_gemm") and bool(ops().amx_available())


def prefill_attention_op():
    """The native prompt-attention op (bf16, head_dim 64) of the selected set: on AMX tiles where it has AMX,
    else the AVX-512 BF16 kernel; None without either (SDPA then takes prompts)."""
    if amx_available() and has_op("amx_prefill_attention"):
        return ops().amx_prefill_attention
    if has_op("prefill_attention"):
        return ops().prefill_attention
    return None


def quant_kernels_available() -> bool:
    """Whether the quantized matmuls (AVX-512 VNNI, or the portable maddubs / sdot ones) were built."""
    return has_op("tiled_skinny_gemm") and has_op("quant_gemm")
