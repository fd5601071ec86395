"""A pool of KV-cache blocks: reference counts, an O(1) LRU free queue, and the hash -> block map.

Freed blocks keep their hash and stay findable until a new allocation evicts them from the front of the
free queue, so the least recently freed cached block goes first; freed blocks without a hash go to the front,
reused before any cached or never-used block. Block 0 is a null block, never handed out:
padding and unused block-table entries point at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.core.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks          # usable blocks; ids 1..num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks + 1)]
        self.null_block = self.blocks[0]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        # the largest block id ever handed out: blocks above it have never held a value (what the idle
        # pre-fault of the KV cache may write over)
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:   # compares token ids too: no collision is trusted
            return None
        return block

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks; only {self.num_free_blocks} are free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
            if block.block_id > self.high_water:
                self.high_water = block.block_id
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash.value) is block:
                del self.cached[block.block_hash.value]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found for a new request; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; cached blocks reaching zero join the free queue's tail in the given order
        (evicted last), blocks without a hash its front. Those hold nothing to find again, so the next
        allocation takes them before it evicts a cached block or writes a never-used one: a never-used page
        costs its first touch (~0.7 ms a block of the embedded model in this project's VMs, 6 of a 128-token
        prompt's ~50 ms), and a block just freed is likely still in the CPU's caches."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

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
        return True
