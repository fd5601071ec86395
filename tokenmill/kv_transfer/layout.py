"""What a KV block means on an instance (model, layers, heads, block size, storage dtype): blocks move between a
prefill and a decode instance only when both layouts are equal."""

from __future__ import annotations

from typing import Any


def kv_layout(config) -> dict[str, Any]:
    """What a block means on this instance: blocks move between instances only when these are all equal."""
    from tokenmill.attention.ops import kv_storage_dtype  # torch: only an engine's process asks
    from tokenmill.model.loader import DTYPES

    m, c = config.model_config, config.cache_config
    storage = kv_storage_dtype(c.cache_dtype, DTYPES[m.dtype])
    return {"model": m.served_model_name, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "block_size": c.block_size, "kv_dtype": str(storage).removeprefix("torch.")}


def layout_mismatch(ours: dict, theirs: dict) -> str | None:
    """None when blocks can move; else a sentence naming every field that differs."""
    diff = [f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in ours if theirs.get(k) != ours.get(k)]
    return "; ".join(diff) or None
