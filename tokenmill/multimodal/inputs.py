"""One media item of a prompt as it travels from the front end to the engine: its encoder inputs, a content hash
and the placeholder positions its embeddings fill."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True):
    """A numpy array as bytes (msgspec encodes no arrays), rebuilt without a copy on the other side."""
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_numpy(cls, a: np.ndarray) -> TensorData:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True):
    """An image of a prompt: the encoder's inputs, and positions [offset, offset + length) of the prompt that its
    embeddings replace. `identifier` is the hash of those inputs: it keys the encoder cache and goes into the
    prefix-cache hashes of the blocks the placeholders fall in, so equal text with another image shares no KV."""
    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, TensorData]

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(modality: str, data: dict[str, np.ndarray]) -> str:
    """A hash of an item's encoder inputs (after preprocessing, so the same picture at another size differs)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(modality.encode())
    for name in sorted(data):
        a = np.ascontiguousarray(data[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def mm_spans(features: list[MultiModalFeature] | None) -> list[tuple[int, int, bytes]]:
    """(first, end, hash) of each item's placeholder positions: the extra keys of the blocks they fall in."""
    return [(f.offset, f.end, bytes.fromhex(f.identifier)) for f in features or ()]


def media_items(mm_data, modality: str, example: str):
    """multi_modal_data's entry for the one modality a model takes (None if absent); a ValueError for
    anything else."""
    if not isinstance(mm_data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'{modality}': {example}}}")
    unknown = sorted(set(mm_data) - {modality})
    if unknown:
        raise ValueError(f"multi_modal_data: this model takes {modality} input only, not {', '.join(unknown)}")
    return mm_data.get(modality)
