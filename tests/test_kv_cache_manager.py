"""Block pool and KV-cache manager, with fake requests and no model."""

from __future__ import annotations

import random

import numpy as np

from tokenmill.core.block_hash import hash_block_tokens
from tokenmill.core.block_pool import BlockPool, first_run
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], **sp) -> Request:
    return Request(rid, tokens, SamplingParams(**sp), max_tokens=16, block_size=BS)


def test_allocate_and_free_ref_counts():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and pool.num_free_blocks == 5
    assert 0 not in {b.block_id for b in blocks}, "block 0 is the null block and is never handed out"
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 7
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 8


def test_hash_chaining():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8]), "a block's hash depends on its parent"
    assert b == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block_tokens(a, [5, 6, 7, 9]) != b
    req = make_req("r", list(range(10)))
    assert len(req.block_hashes) == 2 and req.block_hashes[1].value == hash_block_tokens(
        req.block_hashes[0], [4, 5, 6, 7]).value
    req.append_output_token_ids(10)
    req.append_output_token_ids(11)
    assert len(req.block_hashes) == 3


def test_collision_is_not_trusted():
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks([block], [h], 0, 1)
    forged = type(h)(h.value, (9, 9, 9, 9))   # same hash value, other tokens
    assert pool.get_cached_block(h) is block and pool.get_cached_block(forged) is None


def test_prefix_hit_skips_computed_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", list(range(10)))
    blocks, n = kv.get_computed_blocks(a)
    assert n == 0
    kv.allocate_slots(a, 10)
    b = make_req("b", list(range(8)) + [50, 51, 52])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.get_block_ids("a")[:2]
    kv.allocate_slots(b, 3, blocks, n)
    assert blocks[0].ref_cnt == 2
    # a fully cached prompt still recomputes its last token, for its logits
    c = make_req("c", list(range(8)))
    _, n = kv.get_computed_blocks(c)
    assert n == 4
    assert kv.stats.queries == 10 + 11 + 8 and kv.stats.hits == 8 + 4


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    old, new = make_req("old", list(range(100, 108))), make_req("new", list(range(200, 208)))
    kv.allocate_slots(old, 8)
    kv.allocate_slots(new, 8)
    kv.free(old)
    kv.free(new)
    # freed tail first: old's 2nd block, old's 1st, new's 2nd, new's 1st are evicted in that order
    kv.allocate_slots(make_req("x", list(range(300, 304))), 4)
    assert kv.get_computed_blocks(make_req("o", list(range(100, 109))))[1] == 4   # old's tail block is gone
    assert kv.get_computed_blocks(make_req("n", list(range(200, 209))))[1] == 8   # new is intact
    kv.allocate_slots(make_req("y", list(range(400, 404))), 4)
    assert kv.get_computed_blocks(make_req("o2", list(range(100, 109))))[1] == 0


def test_blocks_without_a_hash_are_reused_before_cached_and_never_used_ones():
    """A freed block that holds no full, hashed block goes to the free queue's front: the next allocation takes
    it rather than a never-used block (whose first touch costs time) or a cached one (whose hit it would lose)."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    cached = make_req("cached", list(range(100, 108)))   # two full blocks: both hashed
    kv.allocate_slots(cached, 8)
    partial = make_req("partial", list(range(200, 206)))   # one full block, one partial (no hash)
    kv.allocate_slots(partial, 6)
    partial_tail = kv.get_block_ids("partial")[1]
    kv.free(cached)
    kv.free(partial)
    assert kv.pool.high_water == 4
    kv.allocate_slots(make_req("x", list(range(300, 303))), 3)
    assert kv.get_block_ids("x") == [partial_tail]
    assert kv.pool.high_water == 4   # no never-used block was written
    assert kv.get_computed_blocks(make_req("c2", list(range(100, 109))))[1] == 8   # the cached ones survive
    uncached = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    for i in range(5):   # one stream after another reuses its own blocks, never the untouched rest
        r = make_req(f"r{i}", list(range(400, 410)))
        uncached.allocate_slots(r, 10)
        uncached.free(r)
    assert uncached.pool.high_water == 3


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = make_req("b", list(range(50, 55)))
    assert kv.allocate_slots(b, 5) is None
    assert kv.pool.num_free_blocks == 0 and "b" not in kv.req_to_blocks
    kv.free(a)
    assert kv.pool.num_free_blocks == 3


def test_cache_salt_separates_tenants():
    """vLLM's cache_salt goes into the first block's hash: the same prompt under another salt (or none) finds
    nothing cached, under the same salt everything."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(20, 33))

    def hits(rid: str, salt: str | None) -> int:
        req = Request(rid, tokens, SamplingParams(), 4, 4, cache_salt=salt)
        blocks, n = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens - n, blocks, n) is not None
        return n

    assert hits("a", "tenant-1") == 0
    assert hits("b", "tenant-1") == 12          # three full blocks; the last token is always recomputed
    assert hits("c", "tenant-2") == 0
    assert hits("d", None) == 0
    assert hits("e", None) == 12


def grow(kv: KVCacheManager, req: Request) -> None:
    """One decoded token: its slot, then the token."""
    assert kv.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids(7)


def test_interleaved_growth_keeps_each_request_in_one_run():
    """Two requests decoding in lockstep each get consecutive blocks (decode attention reads consecutive blocks
    up to 1.6x faster from memory): a new run reserves room for its request's output past it."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a, b = make_req("a", list(range(8))), make_req("b", list(range(50, 58)))
    for r in (a, b):
        kv.allocate_slots(r, 8)
        r.num_computed_tokens = 8
    for _ in range(15):
        grow(kv, a)
        grow(kv, b)
    for rid in ("a", "b"):
        ids = kv.get_block_ids(rid)
        assert len(ids) == 6 and ids == list(range(ids[0], ids[0] + 6)), (rid, ids)
    assert set(kv.get_block_ids("a")).isdisjoint(kv.get_block_ids("b"))
    kv.free(a)
    kv.free(b)
    assert not kv.pool.reserved.any() and kv.pool.num_free_blocks == 32


def test_a_reservation_yields_to_a_real_need():
    """Reserved blocks are still free: a request that finds no other free block takes them, and the owner's
    next block then comes from elsewhere."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(8)))               # 2 blocks, reserves 4 more for its 16 output tokens
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert kv.get_block_ids("a") == [1, 2] and kv.pool.reserved[3:7].all()
    b = make_req("b", list(range(50, 66)))          # 4 blocks: 2 unreserved left, then 2 of a's reservation
    assert kv.allocate_slots(b, 16) is not None
    assert sorted(kv.get_block_ids("b")) == [3, 4, 7, 8]
    for _ in range(5):
        grow(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 5, 6]   # its reservation's rest, past the blocks b took
    assert kv.pool.num_free_blocks == 0
    with_none_free = make_req("c", [1, 2, 3])
    assert kv.allocate_slots(with_none_free, 3) is None


def test_evicted_blocks_are_handed_out_in_ascending_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    r = make_req("r", list(range(100, 116)))       # 4 full blocks, freed tail first: LRU order 4, 3, 2, 1
    kv.allocate_slots(r, 16)
    kv.free(r)
    assert kv.pool.num_plain == 0
    kv.allocate_slots(make_req("x", list(range(300, 307))), 7)
    assert kv.get_block_ids("x") == [3, 4]


def test_first_run():
    avail = np.array([False, True, True, False, True, True, True, False])
    assert [first_run(avail, n) for n in (1, 2, 3, 4, 0)] == [1, 1, 4, -1, -1]
    assert first_run(np.zeros(3, dtype=bool), 1) == -1


def test_blocks_trimmed_off_a_run_are_taken_back_in_place():
    """Rejected drafts' slots go back (trim); the request's next tokens take the same blocks again, so its run
    stays whole."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = make_req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.allocate_slots(a, 1, num_lookahead_tokens=7)   # room for 7 draft tokens past the next one
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    assert kv.trim(a, 9) == 3
    other = Request("other", [5, 6, 7], SamplingParams(), max_tokens=0, block_size=BS)
    kv.allocate_slots(other, 3)                       # one block, first fit: not a's trimmed one
    assert kv.get_block_ids("other") == [7]
    kv.allocate_slots(a, 1, num_lookahead_tokens=7)
    assert kv.get_block_ids("a") == [1, 2, 3, 4]


def test_runs_stay_whole_once_every_free_block_is_cached():
    """A long-running engine with prefix caching: after the first rounds every free block holds a hash, and new
    runs are made by evicting the least recently freed blocks. Requests prefilled a few a step and decoding in
    lockstep still get one run each, round after round."""
    kv = KVCacheManager(num_blocks=600, block_size=16)
    rng = random.Random(0)
    for rnd in range(6):
        reqs = [Request(f"{rnd}-{i}", [rng.randrange(1000) for _ in range(64)], SamplingParams(), max_tokens=64,
                        block_size=16) for i in range(24)]
        running, pending, adjacency = [], list(reqs), []
        while pending or running:
            for r in running:
                grow(kv, r)
            for r in pending[:2]:
                assert kv.allocate_slots(r, 64) is not None
                r.num_computed_tokens = 64
                r.append_output_token_ids(7)
                running.append(r)
            pending = pending[2:]
            for r in [r for r in running if r.num_output_tokens >= 64]:
                ids = kv.get_block_ids(r.request_id)
                adjacency.append(all(b == a + 1 for a, b in zip(ids, ids[1:])))
                kv.free(r)
                running.remove(r)
        assert all(adjacency), (rnd, adjacency.count(False))
    assert kv.pool.num_plain < 600 // 4, "most free blocks still hold their hash"
