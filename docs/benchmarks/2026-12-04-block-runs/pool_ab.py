"""W1 in one engine process, alternating between this project's block pool and an older one (a file given as
OLD, e.g. `git show 5fa48ea:tokenmill/core/block_pool.py > /tmp/old_pool.py`), each keeping its own state across
rounds, so the older pool's free queue scatters blocks as a long-running engine's does. Prints each run's wall
and the share of a request's neighbouring blocks that are consecutive in the cache.

    OLD=/tmp/old_pool.py python pool_ab.py fp8|auto pc|nopc ROUNDS
With CYCLE=1 (and pc): a 1 GiB cache and other prompts each run (token ids shifted), so the prefix cache fills
and every later block comes from evicting a cached one, as in a long-running server.
"""
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.environ.get("PEERS_DIR", "/work/shared/peers"))
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.core.block_pool import BlockPool, Placement  # noqa: E402

spec = importlib.util.spec_from_file_location("old_pool", os.environ.get("OLD", "/tmp/old_pool.py"))
old = importlib.util.module_from_spec(spec)
sys.modules["old_pool"] = old
spec.loader.exec_module(old)


class OldPool(old.BlockPool):
    def allocate(self, n, after=0, reserved_until=0, ahead=0):
        return Placement(self.get_new_blocks(n), 0)

    def reserve(self, ids):
        pass

    def release(self, start, end):
        pass


kv, pc, rounds = sys.argv[1], sys.argv[2] == "pc", int(sys.argv[3])
cycle = bool(os.environ.get("CYCLE"))
llm = LLM(enable_prefix_caching=pc, kv_cache_dtype=kv, **({"kv_cache_memory": "1GiB"} if cycle else {}))
kvm = llm.engine_core.scheduler.kv_cache_manager
pools = {"new": BlockPool(kvm.pool.num_blocks, pc), "old": OldPool(kvm.pool.num_blocks, pc)}
prompts, n = make_prompts("W1")
sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
free = type(kvm).free


def run(name: str, r: int) -> None:
    kvm.pool = pools[name]
    adjacency = []

    def spy(req):
        ids = kvm.get_block_ids(req.request_id)
        adjacency.append(sum(b == a + 1 for a, b in zip(ids, ids[1:])) / max(1, len(ids) - 1))
        free(kvm, req)

    kvm.free = spy
    if pc and not cycle:
        pools[name].reset_prefix_cache()
    shift = 977 * (2 * r + (name == "old")) if cycle else 0
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [(tok + shift) % 49000 for tok in p]} for p in prompts], sp, use_tqdm=False)
    print(f"{kv} pc={pc} round {r} {name}: {time.perf_counter() - t:.2f} s adjacency "
          f"{sum(adjacency) / len(adjacency):.3f}", flush=True)


for r in range(rounds):
    for name in (["new", "old"] if r % 2 == 0 else ["old", "new"]):
        run(name, r)
