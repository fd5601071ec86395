"""A model's config, dtype and limits, read without torch: the API server reads them first thing at start, and
importing torch there would cost it 2-3 s of a cold start that it never needs (the engine core imports torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.model.source import resolve_model

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs, ModelConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")   # each is torch.<name>


def load_hf_config(path: str, fmt: str):
    if fmt == "gguf":
        from tokenmill.model.gguf_config import gguf_hf_config

        return gguf_hf_config(path)
    from transformers import AutoConfig

    if fmt == "ct2":
        from transformers import WhisperConfig

        from tokenmill.model.ct2_file import whisper_config_fields

        return WhisperConfig(**whisper_config_fields(path))
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read config.json in {path}: {e}") from e


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def resolve_dtype(requested: str, hf_config, device: str, cpu_isa: str = "auto") -> str:
    """`--dtype`: a name as given, or for auto the config's own dtype where this device (and on the CPU, the
    kernel set `cpu_isa` selects) runs it well."""
    from tokenmill.platform import default_dtype, runs_well

    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {requested!r}")
        return requested
    # transformers 5 calls it `dtype` (reading `torch_dtype` there only warns); older configs `torch_dtype`
    cfg_dtype = getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") else \
        getattr(hf_config, "torch_dtype", None)
    name = cfg_dtype if isinstance(cfg_dtype, str) else str(cfg_dtype).removeprefix("torch.")
    return name if name in DTYPE_NAMES and runs_well(name, device, cpu_isa) else default_dtype(device, cpu_isa)


def _eos_token_ids(path: str, fmt: str, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = Path(path) / "generation_config.json"
    if fmt == "hf" and gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        for i in (s if isinstance(s, list) else [s]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def load_model_config(args: EngineArgs) -> ModelConfig:
    from tokenmill.config import ModelConfig, check_quantization
    from tokenmill.model.registry import model_class_name, num_labels_of
    from tokenmill.platform import device_type

    source = resolve_model(args.model)
    full_config = load_hf_config(source.path, source.format)
    model_class_name(full_config)  # unknown architectures fail here, before anything heavy
    hf_config = text_config_of(full_config)
    check_quantization(args.quantization, args.quantization_group_size, source.format)  # bad flags fail here too
    quantization = _quantization(args.quantization, full_config)
    tokenizer = args.tokenizer or source.path
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise ValueError(f"tokenizer path {args.tokenizer!r} does not exist")
    return ModelConfig(
        model=source.path, format=source.format, hf_config=hf_config, tokenizer=tokenizer,
        dtype=resolve_dtype(args.dtype, hf_config, device_type(), args.cpu_isa),
        served_model_name=args.served_model_name or source.name,
        max_model_len=model_max_len(hf_config), **_decoder_shape(hf_config),
        eos_token_ids=_eos_token_ids(source.path, source.format, hf_config),
        quantization=quantization, quantization_group_size=args.quantization_group_size,
        enforce_eager=args.enforce_eager, num_labels=num_labels_of(hf_config),
        mm_hf_config=full_config if hf_config is not full_config else None)


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's own quantization_config (a dict with its quant_method), or None."""
    from tokenmill.config import PREQUANTIZED_METHODS

    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") not in PREQUANTIZED_METHODS:
        raise ValueError(f"the checkpoint is quantized with {q.get('quant_method')!r}; tokenmill reads "
                         f"{', '.join(PREQUANTIZED_METHODS)} checkpoints")
    return q


def _quantization(requested: str | None, hf_config) -> str | None:
    """--quantization, or the checkpoint's own method (the two must agree when both are given)."""
    from tokenmill.config import PREQUANTIZED_METHODS

    own = checkpoint_quantization(hf_config)
    if own is None:
        if requested in PREQUANTIZED_METHODS:
            raise ValueError(f"--quantization {requested} needs a checkpoint quantized that way (its config.json "
                             "has no quantization_config)")
        return requested
    if requested not in (None, "none", own["quant_method"]):
        raise ValueError(f"--quantization {requested}: the checkpoint is already quantized with "
                         f"{own['quant_method']}; leave the flag out")
    return own["quant_method"]


def _decoder_shape(cfg) -> dict:
    """The layers and heads whose K/V the paged cache holds: an encoder-decoder model's decoder's."""
    if getattr(cfg, "is_encoder_decoder", False):
        return dict(num_layers=cfg.decoder_layers, num_kv_heads=cfg.decoder_attention_heads,
                    head_dim=cfg.d_model // cfg.decoder_attention_heads)
    return dict(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim_of(cfg))


def text_config_of(hf_config):
    """A vision-language model's language-model config (its text_config); a text model's own config."""
    text = getattr(hf_config, "text_config", None)
    return text if text is not None and getattr(hf_config, "vision_config", None) is not None else hf_config


def model_max_len(hf_config) -> int:
    """The model's own limit; a sliding window does not cap it (those layers attend their last `window` tokens)."""
    if getattr(hf_config, "is_encoder_decoder", False):   # (Whisper: the decoder's learned positions)
        return int(hf_config.max_target_positions)
    return int(getattr(hf_config, "max_position_embeddings", 2048))
