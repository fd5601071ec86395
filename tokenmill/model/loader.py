"""Load a model's weights from a safetensors folder or a GGUF file (its config: model_config.py; its tokenizer:
tokenizer.py; both without torch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.config import PREQUANTIZED_METHODS
from tokenmill.model.model_config import DTYPE_NAMES
from tokenmill.utils import format_bytes, init_logger

if TYPE_CHECKING:
    from tokenmill.config import ModelConfig

logger = init_logger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(model_config: ModelConfig, backend, device: str, max_positions: int) -> torch.nn.Module:
    from tokenmill.layers.quant import get_quant_method
    from tokenmill.model.registry import model_class

    t0 = time.perf_counter()
    hf_config = model_config.mm_hf_config or model_config.hf_config   # a vision model is built from all of it
    cls = model_class(hf_config)
    dtype = DTYPES[model_config.dtype]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, backend, max_positions)
    finally:
        torch.set_default_dtype(prev)
    method = get_quant_method(model_config.quantization, model_config.quantization_group_size, model_config.format,
                              model_config.model)
    model.attach_quant_method(method)
    if model_config.format == "gguf":
        from tokenmill.model.gguf_file import iter_gguf_weights
        from tokenmill.model.start_cache import cached_tensors

        keep = model_config.quantization == "gguf"
        raw = iter_gguf_weights(model_config.model, model_config.hf_config, keep_quantized=keep)
        # dequantized once, then read from the start cache (in float32 where a quantizer reads them)
        weights = raw if keep else cached_tensors(model_config.model, "weights", torch.float32
                                                  if model_config.quantization else dtype, lambda: raw)
    elif model_config.format == "ct2":
        from tokenmill.model.ct2_file import hf_whisper_tensors, iter_ct2_tensors

        weights = hf_whisper_tensors(iter_ct2_tensors(Path(model_config.model) / "model.bin"))
    else:
        weights = iter_safetensors(model_config.model)
    if model_config.quantization in PREQUANTIZED_METHODS:
        from tokenmill.model.model_config import checkpoint_quantization
        from tokenmill.model.prequantized import prequantized_weights

        weights = prequantized_weights(weights, checkpoint_quantization(hf_config), dtype)
    with torch.no_grad():
        model.load_weights(weights)
        if hasattr(method, "prepare"):   # (a method that rewrites the float weights first: w8a8's smoothing)
            method.prepare(model)
        model.process_weights_after_loading()
    model.eval()
    if hasattr(model, "set_enforce_eager"):
        model.set_enforce_eager(model_config.enforce_eager)
    logger.info("loaded %s in %s%s on %s in %.1f s: %s of linear weights", type(model).__name__, model_config.dtype,
                f", weights {model_config.quantization}" if model_config.quantization else "", device,
                time.perf_counter() - t0, format_bytes(linear_weight_bytes(model)))
    windows = [layer.sliding_window for layer in model.attention_layers()]
    if any(windows):
        logger.info("sliding-window attention: %d of %d layers see their last %d tokens (all blocks are kept)",
                    sum(map(bool, windows)), len(windows), max(windows))
    return model


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step's matmuls read, the lm head included (the kernels' copies: packed or quantized)."""
    from tokenmill.layers.linear import Linear

    kernels = [m.kernel for m in model.modules() if isinstance(m, Linear)]
    if getattr(model, "tied", False):
        kernels.append(model.logits_head)
    return sum(getattr(k, "nbytes", 0) for k in kernels)
