"""Model limits and dtype resolution from configs alone (no weights)."""

from __future__ import annotations

import pytest
from transformers import MistralConfig, Qwen2Config

from tokenmill.model.loader import _model_max_len, _resolve_dtype


def test_sliding_window_caps_the_model_length():
    assert _model_max_len(MistralConfig(max_position_embeddings=1024, sliding_window=64)) == 64
    assert _model_max_len(MistralConfig(max_position_embeddings=1024, sliding_window=None)) == 1024
    qwen = Qwen2Config(max_position_embeddings=1024, sliding_window=64, use_sliding_window=False)
    assert _model_max_len(qwen) == 1024


def test_dtype_resolution():
    cfg = MistralConfig(dtype="float32")
    assert _resolve_dtype("auto", cfg, "cpu") == "float32"
    assert _resolve_dtype("bfloat16", cfg, "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        _resolve_dtype("int3", cfg, "cpu")
