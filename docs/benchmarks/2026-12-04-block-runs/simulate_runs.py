"""W1's block allocations alone, no model: 128 requests of 256 random prompt tokens and 128 output tokens, 8
prompts a step beside the running decodes, run again and again on one KV-cache manager with prefix caching on
(so after the first rounds every free block holds a hash). Prints, per round, the mean share of a request's
neighbouring blocks that are consecutive in the cache, and the free plain / cached blocks after it.

    python simulate_runs.py [NUM_BLOCKS] [PRE_EVICT_SHARE]    (5825: a 1 GiB fp8 cache of the embedded model)
"""
import random
import sys

import tokenmill.core.block_pool as block_pool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams

num_blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 5825
if len(sys.argv) > 2:
    block_pool.PRE_EVICT_SHARE = float(sys.argv[2])   # a huge value turns the early eviction off
kv = KVCacheManager(num_blocks, 16)
rng = random.Random(0)
for rnd in range(8):
    reqs = [Request(f"{rnd}-{i}", [rng.randrange(49000) for _ in range(256)], SamplingParams(), 128, 16)
            for i in range(128)]
    running, pending, adjacency = [], list(reqs), []
    while pending or running:
        for r in running:
            assert kv.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
            r.append_output_token_ids(5)
        for r in pending[:8]:
            assert kv.allocate_slots(r, 256) is not None
            r.num_computed_tokens = 256
            r.append_output_token_ids(5)
            running.append(r)
        pending = pending[8:]
        for r in [r for r in running if r.num_output_tokens >= 128]:
            ids = kv.get_block_ids(r.request_id)
            adjacency.append(sum(b == a + 1 for a, b in zip(ids, ids[1:])) / (len(ids) - 1))
            kv.free(r)
            running.remove(r)
    print(f"round {rnd}: adjacency {sum(adjacency) / len(adjacency):.3f}, free plain {kv.pool.num_plain}, "
          f"free cached {len(kv.pool.free_cached)}")
