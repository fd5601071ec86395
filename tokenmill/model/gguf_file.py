"""Read a GGUF file's tensors, dequantized (or kept in their blocks) under HF names; its config: gguf_config.py."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from tokenmill.model.gguf_config import gguf_architecture, gguf_reader

# llama.cpp's converter permutes q/k rows of these architectures for its rope layout; we undo it.
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        sub = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{sub}.{m.group(3)}" if sub else None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_gguf_weights(path: str, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
    """Yield (HF name, float32 tensor) for every tensor, dequantized with the gguf package; with
    keep_quantized, 2-D tensors in Q8_0 / Q4_0 / Q4_1 blocks come as QuantizedWeight instead (and other block
    types fail: they have no kernel)."""
    from gguf.quants import dequantize

    from tokenmill.model.gguf_blocks import KEPT_TYPES, read_blocks

    r = gguf_reader(path)
    arch = gguf_architecture(path)
    for t in r.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        heads = None
        if arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
        kind = t.tensor_type.name
        if keep_quantized and kind not in ("F32", "F16", "BF16") and len(t.shape) == 2:
            if kind not in KEPT_TYPES:
                raise ValueError(f"--quantization gguf: tensor {t.name} is {kind}, which has no kernel; supported "
                                 f"block types: {', '.join(KEPT_TYPES)} (without --quantization it loads "
                                 "dequantized)")
            qw = read_blocks(t.data, kind, (int(t.shape[1]), int(t.shape[0])))
            if heads is not None:
                qw = qw.rows(torch.from_numpy(_unpermute(np.arange(qw.shape[0]), heads)))
            yield name, qw
            continue
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if heads is not None:
            w = _unpermute(w, heads)
        yield name, torch.from_numpy(np.ascontiguousarray(w))
