"""The dense gated MLP of the Llama family (SiLU or GELU), with the native fused silu-and-mul where it runs;
the shared expert of a mixture-of-experts layer is one too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tokenmill.kernels as kernels
from tokenmill.layers.linear import Linear, MergedLinear

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaMLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter] * 2, bias=bias, parallel="column")
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias, parallel="row")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.is_silu = act == "silu"
        self.native = False
        self.gated = None  # the gate/up kernel's fused silu-and-mul, where it has one

    def process_weights_after_loading(self) -> None:
        """After gate_up_proj's own (its kernel decides whether a fused gated path exists)."""
        self.native = self.is_silu and kernels.native_kernels_for(self.gate_up_proj.weight)
        self.ops = kernels.ops() if self.native else None   # this engine's kernel set, whatever starts later
        self.gated = getattr(self.gate_up_proj.kernel, "silu_and_mul", None) if self.native else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None and not self.gate_up_proj.lora_active:
            h = self.gated(x)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.native and gate_up.dim() == 2:
            h = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            self.ops.silu_and_mul(h, gate_up)
            return self.down_proj(h)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)
