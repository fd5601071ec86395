"""Maps `architectures` in config.json to the class that runs it. The map names modules, imported only when a
model is built: the API server checks the architecture at start without importing torch."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "tokenmill.model.llama:LlamaForCausalLM",
    # vision-language: a vision tower and projector before the language model (multimodal/ preprocesses)
    "LlavaForConditionalGeneration": "tokenmill.model.llava:LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "tokenmill.model.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "tokenmill.model.qwen2_vl:Qwen2VLForConditionalGeneration",
    # encoder-decoder: an audio encoder, cross-attention KV as a second cache group (multimodal/audio.py preprocesses)
    "WhisperForConditionalGeneration": "tokenmill.model.whisper:WhisperForConditionalGeneration",
    # cross-encoders (/v1/score, /v1/rerank): the decoder and a score head at the last token
    "LlamaForSequenceClassification": "tokenmill.model.llama_classifier:LlamaForSequenceClassification",
    "MistralForSequenceClassification": "tokenmill.model.llama_classifier:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "tokenmill.model.llama_classifier:LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": "tokenmill.model.llama_classifier:LlamaForSequenceClassification",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class_name(hf_config) -> str:
    """'module:Class' of the config's architecture; an unknown one is a ValueError naming what is supported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"unknown architecture {archs or '(none)'}; supported: {', '.join(supported_architectures())}")


def num_labels_of(hf_config) -> int:
    """A cross-encoder's number of labels (its score head's width); 0 for a generative model."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return int(getattr(hf_config, "num_labels", 1) or 1)
    return 0


def model_class(hf_config) -> type:
    module, _, name = model_class_name(hf_config).partition(":")
    return getattr(importlib.import_module(module), name)
