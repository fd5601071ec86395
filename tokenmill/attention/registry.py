"""Attention backends by name; imports of optional accelerators stay inside each backend."""

from __future__ import annotations

from tokenmill.attention.backend import AttentionBackend
from tokenmill.utils import init_logger

logger = init_logger(__name__)


def available_backends() -> list[str]:
    return ["cpu", "triton", "torch_sdpa", "torch_ref"]


def default_backend_name(device: str) -> str:
    """The CPU's native kernels; on a GPU the Triton decode kernel where Triton is installed."""
    if device == "cpu":
        return "cpu"
    from tokenmill.kernels.gpu import available

    return "triton" if available(device) else "torch_sdpa"


def get_backend(name: str | None, device: str) -> AttentionBackend:
    explicit = name is not None
    name = name or default_backend_name(device)
    if name == "cpu" and not explicit:
        import tokenmill.kernels as kernels

        if kernels.ops() is None:   # --cpu-isa none (or no compiler): torch's attention, as asked
            name = "torch_sdpa"
    if name == "cpu":
        from tokenmill.attention.cpu import CpuPagedBackend

        try:
            return CpuPagedBackend()
        except RuntimeError:
            if explicit:
                raise
            logger.warning("falling back to the torch_sdpa attention backend")
            name = "torch_sdpa"
    if name == "triton":
        from tokenmill.kernels.gpu import available

        if not available(device):
            raise ValueError("attention_backend 'triton' needs Triton (pip install triton) and a CUDA device, or "
                             "TRITON_INTERPRET=1 on the CPU")
        from tokenmill.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch_ref":
        from tokenmill.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "torch_sdpa":
        from tokenmill.attention.torch_sdpa import TorchSdpaBackend

        return TorchSdpaBackend()
    raise ValueError(f"unknown attention_backend {name!r}; available: {', '.join(available_backends())}")
