"""Load a model's config, tokenizer and weights from a safetensors folder or a GGUF file."""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.model.source import resolve_model
from tokenmill.utils import format_bytes, init_logger

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs, ModelConfig

logger = init_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(path: str, fmt: str):
    if fmt == "gguf":
        from tokenmill.model.gguf_file import gguf_hf_config

        return gguf_hf_config(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read config.json in {path}: {e}") from e


def _resolve_dtype(requested: str, hf_config, device: str) -> str:
    from tokenmill.platform import default_dtype, runs_well

    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {requested!r}")
        return requested
    # transformers 5 calls it `dtype` (reading `torch_dtype` there only warns); older configs `torch_dtype`
    cfg_dtype = getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") else \
        getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = DTYPES.get(cfg_dtype)
    dtype = cfg_dtype if cfg_dtype in DTYPES.values() and runs_well(cfg_dtype, device) else default_dtype(device)
    return next(k for k, v in DTYPES.items() if v == dtype)


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
    from tokenmill.config import ModelConfig
    from tokenmill.model.llama import head_dim_of
    from tokenmill.model.registry import model_class
    from tokenmill.platform import device_type

    source = resolve_model(args.model)
    hf_config = load_hf_config(source.path, source.format)
    model_class(hf_config)  # unknown architectures fail here, before anything heavy
    from tokenmill.layers.quant import get_quant_method

    get_quant_method(args.quantization, args.quantization_group_size, source.format)  # bad flags fail here too
    tokenizer = args.tokenizer or source.path
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise ValueError(f"tokenizer path {args.tokenizer!r} does not exist")
    return ModelConfig(
        model=source.path, format=source.format, hf_config=hf_config, tokenizer=tokenizer,
        dtype=_resolve_dtype(args.dtype, hf_config, device_type()),
        served_model_name=args.served_model_name or source.name,
        max_model_len=_model_max_len(hf_config),
        num_layers=hf_config.num_hidden_layers, num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim_of(hf_config), eos_token_ids=_eos_token_ids(source.path, source.format, hf_config),
        quantization=args.quantization, quantization_group_size=args.quantization_group_size)


def _model_max_len(hf_config) -> int:
    """The model's own limit; a sliding window does not cap it (those layers attend their last `window` tokens)."""
    return int(getattr(hf_config, "max_position_embeddings", 2048))


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """A transformers fast tokenizer; for a GGUF file it is built from the file's own vocabulary (~10 s), once:
    later starts read the start cache's saved copy."""
    from transformers import AutoTokenizer

    from tokenmill.model.start_cache import cached_folder

    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return AutoTokenizer.from_pretrained(path)

    def from_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)

    folder = cached_folder(path, "tokenizer", lambda tmp: from_file().save_pretrained(str(tmp)))
    return from_file() if folder is None else AutoTokenizer.from_pretrained(str(folder))


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
    cls = model_class(model_config.hf_config)
    dtype = DTYPES[model_config.dtype]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(model_config.hf_config, backend, max_positions)
    finally:
        torch.set_default_dtype(prev)
    model.attach_quant_method(get_quant_method(model_config.quantization, model_config.quantization_group_size,
                                               model_config.format))
    if model_config.format == "gguf":
        from tokenmill.model.gguf_file import iter_gguf_weights
        from tokenmill.model.start_cache import cached_tensors

        keep = model_config.quantization == "gguf"
        raw = iter_gguf_weights(model_config.model, model_config.hf_config, keep_quantized=keep)
        # dequantized once, then read from the start cache (in float32 where a quantizer reads them)
        weights = raw if keep else cached_tensors(model_config.model, "weights", torch.float32
                                                  if model_config.quantization else dtype, lambda: raw)
    else:
        weights = iter_safetensors(model_config.model)
    with torch.no_grad():
        model.load_weights(weights)
        model.process_weights_after_loading()
    model.eval()
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
