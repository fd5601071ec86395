"""A pool of KV-cache blocks: reference counts, placement that keeps each request's blocks in consecutive runs,
an LRU queue of free cached blocks, and the hash -> block map.

Free blocks are of two kinds. Plain ones hold no hash (never used, or freed with a partial block): they are
handed out first, the lowest ids first, so a stream reuses the pages it has touched before writing a never-used
one (a never-used page costs its first touch, ~0.7 ms a block of the embedded model in this project's VMs).
Cached ones keep their hash and stay findable until an allocation evicts them, least recently freed first.

Decode attention reads a request's blocks one after another; from memory it reads consecutive blocks up to 1.6x
faster than scattered ones (fp8 cache, e4626e1:docs/benchmarks/2026-12-04-block-runs). So an allocation continues the
request's last block where the next one is free, and a new run is placed where `ahead` more free blocks follow it:
those are softly reserved for the request's growth. A soft reservation only orders the choice: any allocation
that finds no other plain block takes reserved ones before it evicts a cached block. Cached blocks are evicted
in LRU order only (a request's blocks are freed tail first, so its prefix is the last to go): the blocks of one
eviction are handed out in ascending order. Where no plain blocks make room for a new run and its reservation
and the free cached blocks are many (PRE_EVICT_SHARE times that), the run evicts that many least recently freed
blocks at once (an earlier request's run, freed together) and is placed on them: blocks evicted a little before
the cache would have had to, from its least recently used end, and plain leftovers that later runs fill. Without
it a long-running engine's runs fell apart again (W1's allocations repeated on a 5,825-block cache: 0.78, 0.62,
0.55, 0.42 ... 0.24 of neighbouring blocks consecutive; with it 1.00). Block 0 is a null block, never handed out:
padding and unused block-table entries point at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tokenmill.core.block_hash import BlockHash

# a new run evicts cached blocks ahead of need only while the free cached blocks are this many times what it
# takes, so that a small cache keeps strict LRU eviction
PRE_EVICT_SHARE = 8


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class Placement:
    """Blocks handed to a request, and the end (exclusive) of its soft reservation past the last of them."""
    blocks: list[KVCacheBlock]
    reserved_until: int


def first_run(avail: np.ndarray, length: int) -> int:
    """The lowest index that starts `length` consecutive True entries of `avail`, or -1."""
    if length <= 0 or length > avail.size:
        return -1
    counts = np.concatenate(([0], np.cumsum(avail, dtype=np.int64)))
    hits = np.flatnonzero(counts[length:] - counts[:-length] == length)
    return int(hits[0]) if hits.size else -1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks          # usable blocks; ids 1..num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks + 1)]
        self.null_block = self.blocks[0]
        self.plain = np.ones(num_blocks + 1, dtype=bool)      # free and holding no hash
        self.plain[0] = False
        self.num_plain = num_blocks
        self.reserved = np.zeros(num_blocks + 1, dtype=bool)  # softly kept for a request's growth
        self.free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()   # free with a hash; LRU first
        self.cached: dict[bytes, KVCacheBlock] = {}
        # called with a free cached block that is about to lose its hash for reuse (the KV offload tier's hook)
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # the largest block id ever handed out: blocks above it have never held a value (what the idle
        # pre-fault of the KV cache may write over)
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_plain + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return bool(self.plain[block_id]) or block_id in self.free_cached

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:   # compares token ids too: no collision is trusted
            return None
        return block

    def take_plain(self) -> KVCacheBlock | None:
        """One plain (hash-free) block, the lowest free one, or None; never evicts a cached block."""
        ids = np.flatnonzero(self.plain & ~self.reserved)[:1].tolist() or np.flatnonzero(self.plain)[:1].tolist()
        return self._take(ids)[0] if ids else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks for a new owner that reserves nothing past them."""
        return self.allocate(n).blocks

    def allocate(self, n: int, after: int = 0, reserved_until: int = 0, ahead: int = 0) -> Placement:
        """n blocks for a request whose last block is `after` (0: it has none) and whose reservation runs to
        `reserved_until`; `ahead`: how many more blocks to reserve if a new run starts. In this order: the
        plain blocks right after `after` (reserved for it or for none); a new run of plain unreserved blocks
        (with `ahead` more after it, else without); the lowest plain blocks, unreserved then reserved; cached
        blocks, least recently freed first, handed out in ascending order."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks; only {self.num_free_blocks} are free")
        ids: list[int] = []
        nxt = after + 1
        while after and len(ids) < n and nxt <= self.num_blocks and self.plain[nxt] and (
                nxt < reserved_until or not self.reserved[nxt]):
            ids.append(nxt)
            nxt += 1
        out = self._take(ids)
        need = n - len(ids)
        if need == 0:
            return Placement(out, max(reserved_until, nxt))
        self.release(nxt, reserved_until)
        avail = self.plain & ~self.reserved
        start = first_run(avail, need + ahead)
        if start < 0 and len(self.free_cached) >= PRE_EVICT_SHARE * (need + ahead):
            # plain blocks are few or scattered and the cache will evict soon: evict the least recently freed
            # blocks for this run now, all at once (an earlier request's run, freed together), not one a step
            for _ in range(need + ahead):
                self._uncache(self.free_cached.popitem(last=False)[1])
            avail = self.plain & ~self.reserved
            start = first_run(avail, need + ahead)
        if start < 0:
            start = first_run(avail, need)
        if start >= 0:
            out += self._take(range(start, start + need))
            return Placement(out, self._reserve(start + need, ahead))
        ids = np.flatnonzero(avail)[:need].tolist()   # fragmented: single blocks, lowest first
        if len(ids) < need:                            # a reservation yields to a real need
            ids += np.flatnonzero(self.plain & self.reserved)[: need - len(ids)].tolist()
        out += self._take(ids)
        if len(out) == n:
            return Placement(out, 0)
        lru = iter(self.free_cached)
        evicted = sorted(next(lru) for _ in range(n - len(out)))
        out += self._take(evicted)
        return Placement(out, self._reserve(evicted[-1] + 1, ahead))

    def _reserve(self, start: int, ahead: int) -> int:
        """Softly reserve up to `ahead` plain, unreserved blocks from `start` on; the end of the reservation."""
        end = start
        while end < start + ahead and end <= self.num_blocks and self.plain[end] and not self.reserved[end]:
            self.reserved[end] = True
            end += 1
        return end

    def _uncache(self, block: KVCacheBlock) -> None:
        """A free cached block becomes plain: its hash is dropped."""
        self._evict(block)
        self._make_plain(block.block_id)

    def _make_plain(self, block_id: int) -> None:
        self.plain[block_id] = True
        self.num_plain += 1

    def _take(self, ids: Iterable[int]) -> list[KVCacheBlock]:
        out = []
        for i in ids:
            block = self.blocks[i]
            if self.plain[i]:
                self.plain[i] = False
                self.num_plain -= 1
            else:
                del self.free_cached[i]
            self.reserved[i] = False
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
            if i > self.high_water:
                self.high_water = i
        return out

    def reserve(self, block_ids: list[int]) -> None:
        """Softly reserve plain blocks for the request whose run they continue."""
        for i in block_ids:
            if self.plain[i]:
                self.reserved[i] = True

    def release(self, start: int, end: int) -> None:
        """Give up a soft reservation of blocks start..end-1."""
        if start < end:
            self.reserved[start:end] = False

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block)
            if self.cached.get(block.block_hash.value) is block:
                del self.cached[block.block_hash.value]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found for a new request; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_cached[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Blocks reaching zero become plain if they hold no hash (nothing to find
        again: the next allocation may take them before it evicts a cached block or writes a never-used one,
        and a block just freed is likely still in the CPU's caches), else join the cached queue's tail in the
        given order (evicted last)."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._make_plain(block.block_id)
                else:
                    self.free_cached[block.block_id] = block

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[BlockHash], start: int, end: int) -> None:
        """Register blocks[start:end] (now full, their hashes known) for reuse by later requests."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks[start:end], hashes[start:end]):
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            self.cached.setdefault(block_hash.value, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.plain[1:] = True   # every block is free
        self.num_plain = self.num_blocks
        self.free_cached.clear()
        self.reserved[:] = False
        return True
