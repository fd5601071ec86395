"""A GGUF file's metadata as a model config (the tensors are read in gguf_file.py). Imports no torch: the API
server reads the config at start and never needs torch otherwise."""

from __future__ import annotations

import copy
from functools import lru_cache

# GGUF architecture -> (HF architecture, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


class PlainConfig:
    """A model config as its fields, as transformers' config class of the model set them (`to_dict()`).

    Why not that class: transformers' config module imports torch (for its rope helpers) and the model-specific
    classes its model-loading code, ~2-5 s of a cold start in each process that reads one; the engine reads only
    the fields. `typed_hf_config` gives the class back where an HF folder is written."""

    def __init__(self, fields: dict):
        self.__dict__.update(copy.deepcopy(fields))

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def __eq__(self, other) -> bool:
        return isinstance(other, PlainConfig) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__!r})"


@lru_cache(maxsize=4)
def gguf_reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_architecture(path: str) -> str:
    return str(_field(gguf_reader(path), "general.architecture"))


def gguf_hf_config(path: str):
    """The config of a GGUF file: built from its metadata once (parsing the file takes seconds), then read from
    the start cache as a `PlainConfig` holding every field the model class set."""
    import json

    from tokenmill.model.start_cache import cached_folder

    def build(tmp) -> None:
        (tmp / "config.json").write_text(json.dumps(_build_hf_config(path).to_dict(), indent=1))

    folder = cached_folder(path, "config-fields", build)  # (the "config" entries held a diff from the defaults)
    if folder is None:
        return _build_hf_config(path)
    fields = json.loads((folder / "config.json").read_text())
    fields["_name_or_path"] = ""   # as built: the cache folder is no name of the model
    if isinstance(fields.get("id2label"), dict):   # JSON made its keys strings; transformers keeps ints
        fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
    return PlainConfig(fields)


def typed_hf_config(config):
    """The model-specific transformers class of a plain config read from the start cache (LlamaConfig...), for
    what writes an HF folder: a plain config's config.json would lack its model_type."""
    from transformers import AutoConfig

    if not isinstance(config, PlainConfig):
        return config
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return AutoConfig.for_model(config.model_type, **fields)


def _build_hf_config(path: str):
    from transformers import AutoConfig

    r = gguf_reader(path)
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
