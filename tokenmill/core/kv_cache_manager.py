"""Hands out KV-cache blocks to requests on demand and finds cached prefixes (automatic prefix caching)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.kv_offload import OffloadIndex
from tokenmill.engine.request import Request
from tokenmill.utils import cdiv

# how many blocks of a request's output a new run reserves past it (256 tokens of 16-token blocks)
MAX_AHEAD = 16


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, found in the cache (the offload tier's included)
    offload_hits: int = 0   # of the hits, copied back from the offload tier (beyond the device cache)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 offload: OffloadIndex | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.offload = offload if enable_caching else None
        if self.offload is not None:
            self.pool.on_evict = lambda block: self.offload.evicted(block.block_id, block.block_hash)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # how many of a request's blocks are registered in the cache
        self.reserved_until: dict[str, int] = {}      # the end of a request's soft reservation past its last block
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request, count: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request in whole blocks. The last prompt token is always
        recomputed, because its logits are needed; prompt logprobs and mean or first-token pooling need every
        position computed (a cached block has no outputs). `count=False` looks without adding to the hit rate."""
        sp = request.sampling_params
        if not self.enable_caching or sp.prompt_logprobs is not None or sp.pooling in ("mean", "cls"):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        restored = self._restore(request, blocks, max_blocks) if count and self.offload is not None else 0
        if count:
            self.stats.queries += request.num_tokens
            self.stats.hits += len(blocks) * self.block_size
            self.stats.offload_hits += restored * self.block_size
        return blocks, len(blocks) * self.block_size

    def _restore(self, request: Request, blocks: list[KVCacheBlock], max_blocks: int) -> int:
        """Extend the device cache's hits with the offload tier's: each next block it holds is copied back (at the
        start of the next step) into a free block, which becomes an ordinary cached block; the device hits are
        held meanwhile so that making room never evicts them. Returns how many came back."""
        following = request.block_hashes[len(blocks):max_blocks]
        if not following or not self.offload.find(following[0]):
            return 0   # (the usual lookup: nothing to copy back, the device hits untouched)
        self.pool.touch(blocks)
        restored = []
        for block_hash in following:
            if not self.pool.num_free_blocks or not self.offload.find(block_hash):
                break
            block = self.pool.get_new_blocks(1)[0]   # evicting the least recently used block if it must
            self.pool.cache_full_blocks([block], [block_hash], 0, 1)
            self.offload.restore(block_hash, block.block_id)
            restored.append(block)
        self.pool.free_blocks(blocks + restored)   # free and cached: the request's allocation takes them as hits
        blocks.extend(restored)
        return len(restored)

    def _fits(self, num_needed: int, computed_blocks: list[KVCacheBlock]) -> bool:
        """Whether num_needed new blocks are free besides the cached blocks about to be taken: cached blocks with no
        owner sit in the free queue, so taking them uses up free blocks too."""
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return num_needed <= self.pool.num_free_blocks - num_evictable_hits

    def has_room(self, request: Request, computed_blocks: list[KVCacheBlock]) -> bool:
        """Whether the free blocks hold all of a request that is not running yet (its prompt, or everything it had
        when it was preempted), beyond the cached blocks it starts from."""
        return self._fits(cdiv(request.num_tokens, self.block_size) - len(computed_blocks), computed_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` (and `num_lookahead_tokens` past them, where a
        draft model writes its own cache); None (and no change) if the pool cannot."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        if not self._fits(max(num_needed, 0), new_computed_blocks):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self._place(request, blocks, num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        self._cache_blocks(request, min(total_tokens, request.num_tokens))
        return new_blocks

    def _place(self, request: Request, blocks: list[KVCacheBlock], n: int) -> list[KVCacheBlock]:
        """n new blocks for a request, after its last one where that is free. A new run reserves room for the
        rest of the request's prompt and up to MAX_AHEAD blocks of its output past them."""
        rid = request.request_id
        life = cdiv(request.num_prompt_tokens + request.max_tokens, self.block_size) - len(blocks) - n
        prompt_left = cdiv(request.num_prompt_tokens, self.block_size) - len(blocks) - n
        ahead = max(0, min(life, max(prompt_left, 0) + MAX_AHEAD))
        placed = self.pool.allocate(n, blocks[-1].block_id if blocks else 0, self.reserved_until.get(rid, 0), ahead)
        self.reserved_until[rid] = placed.reserved_until
        return placed.blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full > start:
            self.pool.cache_full_blocks(self.req_to_blocks[rid], request.block_hashes, start, num_full)
            self.num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Give back the blocks past the first `num_tokens` tokens (rejected drafts' slots); the number of blocks
        kept if any went back, else None. Trimmed blocks hold no cached (full, known) tokens."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        self.pool.free_blocks(reversed(blocks[keep:]))
        # the trimmed blocks that continued the run stay the request's: its next tokens will want them again
        if keep:
            last, run_end = blocks[keep - 1].block_id, self.reserved_until.get(request.request_id, 0)
            self.pool.reserve([b.block_id for b in blocks[keep:] if last < b.block_id < run_end])
        del blocks[keep:]
        return keep

    def free(self, request: Request) -> None:
        """Give back a request's blocks, tail first, so its last blocks are evicted before its shared prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        until = self.reserved_until.pop(request.request_id, 0)
        if blocks:
            self.pool.release(blocks[-1].block_id + 1, until)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def take_stats(self) -> PrefixCacheStats:
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats
