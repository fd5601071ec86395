"""tokenmill's native CPU kernels: paged attention, bf16 matmuls on the AMX tile layout and fused elementwise ops."""

from __future__ import annotations

import functools

import torch

# The row limit of a native path that takes any batch (the vector tile matmul, or oneDNN past AMX's rows).
ANY_ROWS = 1 << 30


@functools.lru_cache(maxsize=1)
def _fused_ops_built() -> bool:
    from tokenmill.kernels.build import load_cpu_kernels  # not at import: `python -m tokenmill.kernels.build`

    return load_cpu_kernels() and hasattr(torch.ops.tokenmill, "tiled_skinny_gemm")


def native_kernels_for(t: torch.Tensor) -> bool:
    """Whether the native bf16 kernels can take this layer's work: bf16 on the CPU, with the kernels built
    (the AVX-512 BF16 ones are only compiled where the CPU has that instruction set). fp32 always takes the
    torch path, which is transformers' exact sequence of operations."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and _fused_ops_built()


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether the AMX matmul can run: kernels built with AMX, the CPU has it, and Linux grants its state."""
    return _fused_ops_built() and bool(torch.ops.tokenmill.amx_available())


@functools.lru_cache(maxsize=1)
def prefill_attention_op():
    """The native prompt-attention op (bf16, head_dim 64) for this CPU: on AMX tiles where it has AMX, else the
    AVX-512 BF16 kernel; None without either (SDPA then takes prompts)."""
    if amx_available():
        return torch.ops.tokenmill.amx_prefill_attention
    if _fused_ops_built() and hasattr(torch.ops.tokenmill, "prefill_attention"):
        return torch.ops.tokenmill.prefill_attention
    return None


@functools.lru_cache(maxsize=1)
def quant_kernels_available() -> bool:
    """Whether the quantized matmuls (AVX-512 VNNI) were built."""
    return _fused_ops_built() and hasattr(torch.ops.tokenmill, "quant_gemm")
