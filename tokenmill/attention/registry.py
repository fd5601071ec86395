"""Attention backends by name; imports of optional accelerators stay inside each backend."""

from __future__ import annotations

from tokenmill.attention.backend import AttentionBackend


def available_backends() -> list[str]:
    return ["torch_ref", "torch_sdpa"]


def default_backend_name(device: str) -> str:
    return "torch_sdpa"


def get_backend(name: str | None, device: str) -> AttentionBackend:
    name = name or default_backend_name(device)
    if name == "torch_ref":
        from tokenmill.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "torch_sdpa":
        from tokenmill.attention.torch_sdpa import TorchSdpaBackend

        return TorchSdpaBackend()
    raise ValueError(f"unknown attention_backend {name!r}; available: {', '.join(available_backends())}")
