"""Read a GGUF file: its metadata as a transformers config, and its tensors dequantized to HF names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch

# GGUF architecture -> (HF architecture, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp's converter permutes q/k rows of these architectures for its rope layout; we undo it.
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@lru_cache(maxsize=4)
def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_architecture(path: str) -> str:
    return str(_field(_reader(path), "general.architecture"))


def gguf_hf_config(path: str):
    """The transformers config of a GGUF file: built from its metadata once (parsing the file takes seconds),
    then read from the start cache as a plain config holding every field the model class set. Why plain: the
    model-specific classes (LlamaConfig...) import transformers' model-loading machinery and
    torch.distributed.tensor on the way (~2 s of a cold start, in each process that reads the config); the
    engine only reads the fields."""
    import json

    from transformers.configuration_utils import PretrainedConfig

    from tokenmill.model.start_cache import cached_folder

    def build(tmp) -> None:
        (tmp / "config.json").write_text(json.dumps(_build_hf_config(path).to_dict(), indent=1))

    folder = cached_folder(path, "config-fields", build)  # (the "config" entries held a diff from the defaults)
    if folder is None:
        return _build_hf_config(path)
    fields = json.loads((folder / "config.json").read_text())
    config = PretrainedConfig.from_dict(fields)
    for key, value in fields.items():   # (from_dict drops a few generation-time fields, e.g. use_cache)
        if not hasattr(config, key):
            setattr(config, key, value)
    config._name_or_path = ""   # as built: the cache folder is no name of the model
    return config


def typed_hf_config(config):
    """The model-specific transformers class of a plain config read from the start cache (LlamaConfig...), for
    what writes an HF folder: a plain config's config.json would lack its model_type."""
    from transformers import AutoConfig
    from transformers.configuration_utils import PretrainedConfig

    if type(config) is not PretrainedConfig:
        return config
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return AutoConfig.for_model(config.model_type, **fields)


def _build_hf_config(path: str):
    from transformers import AutoConfig

    r = _reader(path)
    arch = gguf_architecture(path)
    if arch not in _ARCHS:
        raise ValueError(f"unknown architecture {arch!r} in {path}; supported GGUF architectures: "
                         f"{', '.join(sorted(_ARCHS))}")
    hf_arch, model_type = _ARCHS[arch]

    def g(key, default=None):
        return _field(r, f"{arch}.{key}", default)

    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tensor_names = {t.name for t in r.tensors}
    vocab = g("vocab_size") or len(_field(r, "tokenizer.ggml.tokens", []))
    kwargs = dict(
        architectures=[hf_arch], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_hidden_layers=int(g("block_count")),
        num_attention_heads=n_heads, num_key_value_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("attention.key_length", hidden // n_heads)),
        max_position_embeddings=int(g("context_length", 2048)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"), eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(r, "tokenizer.ggml.padding_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    scaling = g("rope.scaling.type")
    if scaling in ("linear", "llama3"):
        rope.update(rope_type=scaling, factor=float(g("rope.scaling.factor", 1.0)))
    kwargs["rope_parameters"] = rope
    kwargs["rope_theta"] = rope["rope_theta"]
    if model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return AutoConfig.for_model(model_type, **kwargs)


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

    r = _reader(path)
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
