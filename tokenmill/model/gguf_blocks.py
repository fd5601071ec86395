"""GGUF's Q8_0, Q4_0 and Q4_1 blocks read into a QuantizedWeight value for value (no float round trip), so
`--quantization gguf` runs the very numbers in the file."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.layers.quant.tensor import QuantizedWeight

BLOCK = 32
# block type name -> bytes per block of 32 weights
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}
KEPT_TYPES = tuple(BLOCK_BYTES)


def _halves(raw: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 (exact)."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0]
                            .astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: byte j holds weight j in its low nibble and weight j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def read_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """data: the tensor's raw bytes, [rows, bytes per row]; shape: (rows, inputs)."""
    rows, k = shape
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"GGUF block type {type_name} has no kernel; supported: {', '.join(KEPT_TYPES)}")
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, k // BLOCK, BLOCK_BYTES[type_name])
    d = _halves(raw, 0)
    if type_name == "Q8_0":
        q = raw[..., 2:].view(np.int8).reshape(rows, k)
        return QuantizedWeight(torch.from_numpy(q.copy()), d, None, 8, BLOCK)
    if type_name == "Q4_0":  # w = d * (q - 8) = d * q + (-8 d), exact in fp16
        q = _nibbles(raw[..., 2:]).reshape(rows, k).astype(np.int8)
        return QuantizedWeight(torch.from_numpy(q), d, -8.0 * d, 4, BLOCK)
    q = _nibbles(raw[..., 4:]).reshape(rows, k).astype(np.int8)  # Q4_1: w = d * q + m
    return QuantizedWeight(torch.from_numpy(q), d, _halves(raw, 2), 4, BLOCK)
