"""W8A8 (`--quantization w8a8`): int8 weights (one scale per output channel) and, on steps of many rows, int8
activations (one scale per token, found each step), multiplied on the CPU's int8 units (torch._int_mm, oneDNN's
VNNI / AMX-INT8 GEMM: about twice bf16's work per cycle). Steps of few rows (decode) are bound by reading the
weights, not by arithmetic: they keep the weight-only int8 kernel, so W2 is int8's.

SmoothQuant moves the activations' outlier channels into the weights before quantizing: each input channel j of
a layer is divided by s_j where it is made (q/k/v and gate/up: the RMSNorm's weight; o_proj: v_proj's rows;
down_proj: up_proj's rows) and multiplied by s_j in the layer's weight columns, s_j = max|x_j|^0.5 / max|w_j|^0.5
(the same function, exactly, before rounding). The activation maxima come from a calibration
pass (`tokenmill quantize`, over the shipped calibration text), saved next to the model (or in tokenmill's
cache for a file or a folder that cannot be written) and read at start; without them the mode runs unsmoothed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import tokenmill.kernels as kernels
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.tensor import QuantizedWeight
from tokenmill.utils import init_logger

logger = init_logger(__name__)

# Steps of more rows than this multiply int8 by int8; fewer stay on the weight-only kernel (see the docstring).
W8A8_MIN_ROWS = 256
SMOOTHING_ALPHA = 0.5   # (0.35, 0.65 and 0.8 were worse on SmolLM2: +2.25%, +1.83%, +4.01% against +1.46%)
# Layers whose activations stay bf16 (their weights int8): down_proj's input, silu(gate) * up, keeps outliers
# that smoothing does not tame: with it in int8 the perplexity cost was +1.46%, without +0.59% (SmolLM2, the
# quality corpus; int8 weights alone cost +0.49%). q/k/v, o and gate/up each cost 0.0-0.1% more.
W8A8_WEIGHT_ONLY = ("down_proj",)
SMOOTHING_FILE = "w8a8_smoothing.safetensors"   # in a sub-folder beside the weights, so loaders never read it as one


class W8A8Kernel(QuantLinearKernel):
    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(qw, bias, dtype, device)
        if qw.bits != 8 or qw.group != qw.q.shape[1]:
            raise ValueError("w8a8 takes int8 weights with one scale per output channel")
        self.w_t = qw.q.to(device).t()                    # [K, N] view of the int8 rows
        self.w_scale = qw.scale.reshape(-1).to(device, torch.float32)
        self.bias_out = None if bias is None else bias.detach().to(device, torch.float32)
        # the native decoder stack runs the steps the weight-only kernel takes; larger ones come here
        self.max_rows = min(self.max_rows, W8A8_MIN_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= W8A8_MIN_ROWS:
            return super().__call__(x)
        x2 = x.reshape(rows, x.shape[-1])
        if native_ops() and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32):
            ops = kernels.ops()
            xq, sx = ops.w8a8_quantize_rows(x2)
            y = ops.w8a8_scale_rows(torch._int_mm(xq, self.w_t), sx, self.w_scale, self.bias_out, x.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)
        xq, sx = quantize_per_token(x2)
        y = torch._int_mm(xq, self.w_t).to(torch.float32).mul_(self.w_scale).mul_(sx)
        if self.bias_out is not None:
            y.add_(self.bias_out)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if x.numel() // x.shape[-1] > W8A8_MIN_ROWS else super().silu_and_mul(x)


USE_NATIVE_OPS = True   # (tests turn it off to check the torch path against the same formula)


def native_ops() -> bool:
    """Whether the one-pass quantize and scale kernels (kernels/csrc/w8a8_ops.cpp) were built."""
    return USE_NATIVE_OPS and kernels.has_op("w8a8_scale_rows")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows of x and their scales [rows, 1]: x ~ q * scale, |q| <= 127."""
    scale = x.abs().amax(dim=1, keepdim=True).to(torch.float32).clamp_(min=1e-8).div_(127.0)
    q = torch.round(x.to(torch.float32).div_(scale)).clamp_(-127, 127).to(torch.int8)
    return q, scale


# ---- SmoothQuant ---------------------------------------------------------------------------------
def smoothed_layers(model) -> list[tuple[str, torch.nn.Module, object]]:
    """(key, linear layer, where its input's channels are divided) of each Llama-family decoder layer:
    q/k/v and gate/up divide in the norm before them; o_proj in v_proj's rows (one factor per KV head's channel,
    shared by the query heads that read it); down_proj in up_proj's rows (its input is silu(gate) * up; smoothed
    though its activations stay bf16, which still halves the cost: +1.06% unsmoothed, +0.59% smoothed)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out = []
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(attn, "qkv_proj") or not hasattr(mlp, "gate_up_proj"):
            continue
        out += [(f"layers.{i}.attn", attn.qkv_proj, layer.input_layernorm),
                (f"layers.{i}.mlp", mlp.gate_up_proj, layer.post_attention_layernorm),
                (f"layers.{i}.o", attn.o_proj, ("v", attn.qkv_proj, attn.num_heads, attn.num_kv_heads)),
                (f"layers.{i}.down", mlp.down_proj, ("up", mlp.gate_up_proj))]
    return out


def smoothing_path(model_path: str) -> Path | None:
    """Where `tokenmill quantize` saves the activation maxima of `model_path`: beside it in a writable folder,
    else in tokenmill's cache (a .gguf file, the embedded model, a read-only folder)."""
    p = Path(model_path)
    if p.is_dir() and os.access(p, os.W_OK):
        return p / "tokenmill" / SMOOTHING_FILE
    from tokenmill.model.start_cache import entry_dir

    folder = entry_dir(str(p if p.is_file() else p / "config.json"), "w8a8")
    return None if folder is None else folder / SMOOTHING_FILE


def load_activation_maxima(model_path: str) -> dict[str, torch.Tensor] | None:
    path = smoothing_path(model_path)
    if path is None or not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))


def _factors(act: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w_max = w.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (act.float().clamp(min=1e-5).pow(SMOOTHING_ALPHA) / w_max.pow(1 - SMOOTHING_ALPHA)).clamp(min=1e-5)


def _scale_rows(linear, first: int, s: torch.Tensor) -> None:
    """Divides output rows first.. of a (fused) linear layer, and their bias, by s."""
    rows = slice(first, first + s.shape[0])
    w = linear.weight.data
    w[rows] = (w[rows].float() / s[:, None]).to(w.dtype)
    if linear.bias is not None:
        linear.bias.data[rows] = (linear.bias.data[rows].float() / s).to(linear.bias.dtype)


@torch.no_grad()
def apply_smoothing(model, maxima: dict[str, torch.Tensor]) -> int:
    """Folds each layer's s into what feeds it (see smoothed_layers) and into its weight's columns; returns the
    layers smoothed."""
    done = 0
    for key, linear, feeder in smoothed_layers(model):
        act = maxima.get(key)
        if act is None:
            continue
        w = linear.weight
        if act.shape[0] != w.shape[1]:
            raise ValueError(f"w8a8 smoothing for {key} has {act.shape[0]} channels, the layer {w.shape[1]}: "
                             "run `tokenmill quantize` again for this model")
        s = _factors(act, w)
        if isinstance(feeder, tuple) and feeder[0] == "v":
            _, qkv, heads, kv_heads = feeder
            d = s.shape[0] // heads   # one factor per KV head's channel: the largest of its query heads'
            s = s.view(kv_heads, heads // kv_heads, d).amax(dim=1)
            _scale_rows(qkv, qkv.out_sizes[0] + qkv.out_sizes[1], s.reshape(-1))
            s = s.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)
        elif isinstance(feeder, tuple):
            _scale_rows(feeder[1], feeder[1].out_sizes[0], s)
        else:
            feeder.weight.data.copy_((feeder.weight.float() / s).to(feeder.weight.dtype))
        w.data.copy_((w.float() * s).to(w.dtype))
        done += 1
    return done


@torch.no_grad()
def collect_activation_maxima(llm, texts: list[str], max_tokens_per_text: int = 512) -> dict[str, torch.Tensor]:
    """Runs the texts through an eager engine and keeps each norm-fed layer's per-channel input maximum."""
    model = llm.engine_core.executor.runner.model
    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for key, linear, _ in smoothed_layers(model):
        def record(_module, args, key=key):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
            maxima[key] = m if key not in maxima else torch.maximum(maxima[key], m)
        hooks.append(linear.register_forward_pre_hook(record))
    try:
        from tokenmill.sampling_params import SamplingParams

        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok(t).input_ids[:max_tokens_per_text]} for t in texts]
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return maxima
