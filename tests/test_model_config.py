"""Model limits and dtype resolution from configs alone (no weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from tokenmill.model.llama_layers import sliding_window_of
from tokenmill.model.model_config import model_max_len, resolve_dtype


def test_sliding_window_does_not_cap_the_model_length():
    assert model_max_len(MistralConfig(max_position_embeddings=1024, sliding_window=64)) == 1024
    assert model_max_len(MistralConfig(max_position_embeddings=1024, sliding_window=None)) == 1024


def test_sliding_window_per_layer_as_transformers_decides():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    mistral = MistralConfig(sliding_window=64, num_hidden_layers=3)
    assert [sliding_window_of(mistral, i) for i in range(3)] == [64, 64, 64]
    assert sliding_window_of(MistralConfig(sliding_window=None), 0) == 0
    qwen = Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3)
    assert [sliding_window_of(qwen, i) for i in range(3)] == [0, 64, 64]
    off = Qwen2Config(sliding_window=64, use_sliding_window=False, num_hidden_layers=3)
    assert [sliding_window_of(off, i) for i in range(3)] == [0, 0, 0]
    moe = Qwen2MoeConfig(sliding_window=64, use_sliding_window=True, max_window_layers=3, num_hidden_layers=3)
    assert [sliding_window_of(moe, i) for i in range(3)] == [64, 0, 64]
    assert sliding_window_of(Qwen2MoeConfig(sliding_window=64, num_hidden_layers=3), 0) == 0
    assert sliding_window_of(Qwen3MoeConfig(sliding_window=64, use_sliding_window=True), 0) == 64


def test_dtype_resolution():
    cfg = MistralConfig(dtype="float32")
    assert resolve_dtype("auto", cfg, "cpu") == "float32"
    assert resolve_dtype("bfloat16", cfg, "cpu") == "bfloat16"
    assert resolve_dtype("auto", MistralConfig(dtype=torch.float32), "cpu") == "float32"   # a dtype, not a name
    assert resolve_dtype("auto", MistralConfig(dtype=torch.float16), "cpu") in ("bfloat16", "float32")  # not fp16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3", cfg, "cpu")
