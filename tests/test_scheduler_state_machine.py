"""A hypothesis state machine over the scheduler and the KV-cache manager, with no model: random adds (sharing
prefixes), aborts, steps with drafts accepted or rejected, in a pool small enough to preempt. After every rule the
block accounting holds, and after draining every block is free."""

from __future__ import annotations

import collections

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

BS, NUM_BLOCKS = 4, 12
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23], []]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(4, 24), max_seqs=st.integers(1, 6), prompt_cap=st.integers(0, 24))
    def setup(self, budget: int, max_seqs: int, prompt_cap: int):
        config = SchedulerConfig(budget, max_seqs, 64, True, "fcfs", prefill_tokens_while_decoding=prompt_cap)
        self.s = Scheduler(config, CacheConfig(BS, NUM_BLOCKS, True))
        self.added: list[str] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(3, 12), min_size=1, max_size=24),
          max_tokens=st.integers(1, 12))
    def add(self, prefix, tail, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = (prefix + tail)[:50]
        self.s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   max_tokens, BS))
        self.added.append(rid)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule(data=st.data())
    def step(self, data):
        running = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.s.running}
        so = self.s.schedule()
        assert so.total_num_scheduled_tokens <= self.s.config.max_num_batched_tokens
        cap = self.s.config.prefill_tokens_while_decoding
        if cap and any(left <= 1 for left in running.values()):   # someone decodes: prompt tokens within the cap
            assert sum(n for rid, n in so.num_scheduled_tokens.items() if running.get(rid, 2) > 1) <= cap
        ids, sampled, spec = [], [], {}
        for rid in so.num_scheduled_tokens:
            req = self.s.requests[rid]
            ids.append(rid)
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            if req.num_computed_tokens < req.num_tokens:   # still in its prompt
                sampled.append([])
                continue
            k = data.draw(st.integers(0, len(drafts)))
            sampled.append(drafts[:k] + [data.draw(st.integers(3, 12))])
            spec[rid] = data.draw(st.lists(st.integers(3, 12), max_size=3))
        self.s.update_from_output(so, ModelRunnerOutput(ids, sampled, spec_token_ids=spec))

    @invariant()
    def blocks_add_up(self):
        if not hasattr(self, "s"):
            return
        kv = self.s.kv_cache_manager
        pool = kv.pool
        refs = collections.Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_cnt == 0) == pool.is_free(block.block_id), block
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.num_free_blocks + used == pool.num_blocks
        assert pool.null_block.ref_cnt == 0 and not pool.is_free(0)
        assert pool.num_plain == int(pool.plain.sum())
        assert not (pool.reserved & ~pool.plain).any(), "only plain (free, hashless) blocks are reserved"

    @invariant()
    def every_request_has_one_place(self):
        if not hasattr(self, "s"):
            return
        running = {r.request_id for r in self.s.running}
        waiting = {r.request_id for r in self.s.waiting}
        assert not running & waiting
        assert running | waiting == set(self.s.requests)
        assert set(self.s.kv_cache_manager.req_to_blocks) <= set(self.s.requests)
        for req in self.s.running:
            assert req.status == RequestStatus.RUNNING

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(2000):
            if not self.s.has_unfinished_requests():
                break
            so = self.s.schedule()
            ids = list(so.num_scheduled_tokens)
            sampled = [[] if self.s.requests[r].num_computed_tokens < self.s.requests[r].num_tokens else [3]
                       for r in ids]
            self.s.update_from_output(so, ModelRunnerOutput(ids, sampled))
        assert not self.s.has_unfinished_requests(), "requests left after draining"
        pool = self.s.kv_cache_manager.pool
        assert pool.num_free_blocks == pool.num_blocks, "blocks left in use after every request finished"


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
