"""The KV offload tier: blocks evicted from the KV cache are kept by their prefix hash in host RAM (and on disk)
and copied back when a later prompt continues past the cache's hits. The scheduler side is checked against a fake
KV cache whose blocks hold the token ids written into them; the engine's greedy tokens with the tier equal those
without it, with hits the device cache alone could not give."""

from __future__ import annotations

import random

import pytest
from test_scheduler import BS

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams as SP


class FakeKVRunner:
    """Writes each scheduled token's id into its slot of a fake cache, applies the offload ops to a fake store
    first, and checks that every prefix a new request starts from holds that request's own tokens."""

    def __init__(self, num_blocks: int):
        self.kv = [[None] * BS for _ in range(num_blocks + 1)]
        self.store: dict[bytes, list] = {}
        self.disk: dict[bytes, list] = {}
        self.reqs: dict[str, tuple[list[int], list[int], int]] = {}
        self.loaded = 0

    def apply(self, ops) -> None:
        for op in ops.ops:
            if op[0] == "save":
                self.store[op[2]] = list(self.kv[op[1]])
            elif op[0] == "load":
                self.kv[op[2]] = list(self.store[op[1]] if op[1] in self.store else self.disk[op[1]])
                self.loaded += 1
            elif op[0] == "spill":
                self.disk[op[1]] = self.store.pop(op[1])
            else:
                del (self.store if op[2] == "ram" else self.disk)[op[1]]

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.kv_offload is not None:
            self.apply(so.kv_offload)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = (list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for c in so.scheduled_cached_reqs:
            tokens, blocks, _ = self.reqs[c.req_id]
            self.reqs[c.req_id] = (tokens, blocks + c.new_block_ids, c.num_computed_tokens)
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            tokens, blocks, computed = self.reqs[rid]
            for pos in range(computed, computed + n):
                self.kv[blocks[pos // BS]][pos % BS] = tokens[pos]
            done = computed + n >= len(tokens)
            ids.append(rid)
            sampled.append([7] if done else [])
            if done:
                tokens.append(7)
            self.reqs[rid] = (tokens, blocks, computed + n)
        # the cached prefix a new request starts from must hold its own tokens once the step's K/V are written
        # (a model writes every layer's K/V for the whole step before it attends: a request may start from
        # blocks another computes in the same step)
        for new in so.scheduled_new_reqs:
            for pos in range(new.num_computed_tokens):
                assert self.kv[new.block_ids[pos // BS]][pos % BS] == new.token_ids[pos], \
                    f"{new.req_id} position {pos}"
        return ModelRunnerOutput(ids, sampled)


def run(s: Scheduler, runner: FakeKVRunner, reqs: list[Request]) -> None:
    for r in reqs:
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            return
        so = s.schedule()
        s.update_from_output(so, runner(so))
    raise AssertionError("did not finish")


def scheduler(num_blocks: int, offload_blocks: int, disk_blocks: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(64, 4, 256, True, "fcfs"),
                     CacheConfig(BS, num_blocks, True, offload_blocks=offload_blocks,
                                 offload_disk_blocks=disk_blocks))


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SP(max_tokens=max_tokens, ignore_eos=True), max_tokens, BS)


@pytest.mark.parametrize("offload_blocks, disk_blocks", [(64, 0), (6, 64)], ids=["ram", "ram+disk"])
def test_prefix_comes_back_from_the_tier_after_eviction(offload_blocks, disk_blocks):
    s = scheduler(num_blocks=12, offload_blocks=offload_blocks, disk_blocks=disk_blocks)
    runner = FakeKVRunner(12)
    system = list(range(100, 132))   # 8 blocks
    run(s, runner, [request("a", system + [1, 2])])
    run(s, runner, [request(f"evict{i}", [500 + 40 * i + j for j in range(36)]) for i in range(2)])
    s.kv_cache_manager.take_stats()
    run(s, runner, [request("b", system + [3, 4])])
    stats = s.kv_cache_manager.take_stats()
    assert stats.offload_hits == 32 and stats.hits == 32   # all of the system prompt, none of it on the device
    assert runner.loaded == 8


def test_random_workload_only_ever_reuses_its_own_tokens():
    rng = random.Random(4)
    systems = [[rng.randrange(1000) for _ in range(rng.choice([8, 16, 24]))] for _ in range(6)]
    s = scheduler(num_blocks=24, offload_blocks=10, disk_blocks=12)
    runner = FakeKVRunner(24)
    for wave in range(6):
        reqs = [request(f"w{wave}-{i}", rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))],
                        rng.randint(1, 6)) for i in range(5)]
        run(s, runner, reqs)
    assert runner.loaded > 0
    index = s.kv_cache_manager.offload
    assert len(runner.store) == len(index.ram) <= 10 and len(runner.disk) == len(index.disk) <= 12


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def shared_prompts(rounds: int = 2):
    """8 system prompts of 64 tokens, each asked twice with different questions, in rounds: 8 x 4 blocks is
    twice the 16-block cache, so the device cache alone has evicted each system prompt before it comes back."""
    rng = random.Random(8)
    systems = [[rng.randrange(100, 49152) for _ in range(64)] for _ in range(8)]
    return [{"prompt_token_ids": sys_ + [rng.randrange(100, 49152) for _ in range(5)]}
            for _ in range(rounds) for sys_ in systems]


@pytest.mark.parametrize("extra", [{}, {"kv_offload_dir": "DIR", "kv_offload_bytes": "64KiB"}], ids=["ram", "disk"])
def test_engine_tokens_equal_without_the_tier(tiny_llama, tmp_path, extra):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = shared_prompts()
    base = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=16, max_num_seqs=1)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    extra = {k: (str(tmp_path / "kv") if v == "DIR" else v) for k, v in extra.items()}
    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=16, max_num_seqs=1,
              **{"kv_offload_bytes": "64MiB", **extra})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    index = llm.engine_core.scheduler.kv_cache_manager.offload
    assert index.stats.loaded_blocks >= 8 * 3   # the second round found its system prompts in the tier
    assert sum(o.num_cached_tokens for o in outs[8:]) >= 8 * 48
    if "kv_offload_dir" in extra:
        assert index.disk and len(list((tmp_path / "kv").glob("*.kv"))) == len(index.disk)


def test_offload_flags_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(tiny_llama, kv_offload_bytes="1MiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        LLM(tiny_llama, kv_offload_dir="/tmp/x")


def test_copying_back_never_evicts_the_prefix_it_extends():
    """A full device cache whose only free blocks are this prompt's own hits: the tier's next block must not take
    one of them (the request would then start from a block holding other tokens); it waits instead."""
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.kv_offload import OffloadIndex

    kv = KVCacheManager(2, BS, True, OffloadIndex(8))
    req = request("r", list(range(200, 213)))   # 3 full blocks and one token
    first = request("first", req.prompt_token_ids[:8])   # computes blocks 1-2 of the prompt
    assert kv.allocate_slots(first, 8) is not None
    kv.free(first)
    kv.offload.ram[req.block_hashes[2].value] = req.block_hashes[2]   # the third block waits in the tier
    blocks, computed = kv.get_computed_blocks(req)
    assert [b.block_hash for b in blocks] == req.block_hashes[:len(blocks)] and computed == 2 * BS
