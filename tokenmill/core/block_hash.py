"""Chained block hashes: a full block's hash covers its parent's hash and its own token ids, so equal
hashes mean equal prefixes. The token ids travel with the hash so a hit can be checked against collisions."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT = b"tokenmill-root"


@dataclass(frozen=True)
class BlockHash:
    value: bytes
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.value if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return BlockHash(h.digest(), tuple(token_ids))


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        salt: bytes = b"", mm_spans: Sequence[tuple[int, int, bytes]] = ()) -> None:
    """Append the hashes of the blocks of `token_ids` that became full since `hashes` was last extended. A salt
    (a tenant's cache_salt) is mixed into the first block, and through the chain into every later one. A block
    that placeholder positions [first, end) of a media item fall in takes the item's hash too: its tokens are the
    same placeholder ids whatever the image, its KV is not."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        extra = b"" if hashes else salt
        for first, end, key in mm_spans:
            if first < start + block_size and end > start:
                extra += key
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size],
                                        extra))
