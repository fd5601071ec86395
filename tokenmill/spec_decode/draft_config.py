"""The draft model's ModelConfig, checked against the target's at start (same vocabulary, same tokenizer)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs, ModelConfig
    from tokenmill.spec_decode.config import SpeculativeConfig


def load_draft_model_config(spec: SpeculativeConfig, target: ModelConfig, target_args: EngineArgs) -> ModelConfig:
    from tokenmill.config import EngineArgs
    from tokenmill.model.model_config import load_model_config

    if spec.method in ("eagle", "eagle3"):
        return _eagle_head_config(spec, target)
    same_weights = spec.model is None or spec.model == target_args.model
    if same_weights and spec.quantization in (None, target.quantization):
        raise ValueError("speculative_config: a draft with the target's own weights and quantization would propose "
                         "exactly what the target says at the same cost; set \"quantization\": \"int4\" or \"gguf\" "
                         "(the self-draft), or name a smaller \"model\"")
    args = EngineArgs(model=spec.model if spec.model is not None else target_args.model, dtype=target.dtype,
                      quantization=spec.quantization, quantization_group_size=spec.quantization_group_size,
                      enforce_eager=target.enforce_eager)
    try:
        draft = load_model_config(args)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from e
    target_vocab, draft_vocab = int(target.hf_config.vocab_size), int(draft.hf_config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft_vocab} tokens, the target's "
                         f"{target_vocab}; a draft must share the target's tokenizer")
    if not same_weights and draft.tokenizer != target.tokenizer:
        _check_same_tokenizer(draft.tokenizer, target.tokenizer)
    return dataclasses.replace(draft, served_model_name=f"draft:{draft.served_model_name}")


def _eagle_head_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The head's shape, for its KV cache; it runs in the target's dtype and reads the target's hidden states."""
    from pathlib import Path

    from tokenmill.model.model_config import head_dim_of, load_hf_config

    folder = Path(spec.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {spec.model} is not an EAGLE head folder (no config.json)")
    cfg = load_hf_config(str(folder), "hf")
    # an EAGLE-3 head maps the target's states through fc, so only EAGLE-1 needs the target's width
    for key in ("hidden_size", "vocab_size") if spec.method == "eagle" else ("vocab_size",):
        if int(getattr(cfg, key)) != int(getattr(target.hf_config, key)):
            raise ValueError(f"speculative_config.model: the EAGLE head's {key} is {getattr(cfg, key)}, the "
                             f"target's {getattr(target.hf_config, key)}; the head must be trained for this target")
    return dataclasses.replace(target, model=str(folder), format="hf", hf_config=cfg,
                               served_model_name=f"eagle:{folder.name}", num_layers=cfg.num_hidden_layers,
                               num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim_of(cfg), quantization=None)


def _check_same_tokenizer(draft_path: str, target_path: str) -> None:
    from tokenmill.model.tokenizer import load_tokenizer

    try:
        draft_vocab = load_tokenizer(draft_path).get_vocab()
    except Exception as e:  # a folder without tokenizer files, a broken one
        raise ValueError(f"speculative_config.model: cannot load the draft's tokenizer from {draft_path}: {e}") from e
    if draft_vocab != load_tokenizer(target_path).get_vocab():
        raise ValueError("speculative_config.model: the draft's tokenizer maps tokens to different ids than the "
                         "target's; a draft must share the target's tokenizer")
