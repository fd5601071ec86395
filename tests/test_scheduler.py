"""The scheduler with fake requests and a fake model: budgets, chunking, preemption and clean-up."""

from __future__ import annotations

import random

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, policy="fcfs", caching=True, max_len=256):
    return Scheduler(SchedulerConfig(budget, max_seqs, max_len, True, policy),
                     CacheConfig(BS, num_blocks, caching))


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0, base: int = 0) -> Request:
    req = Request(rid, [base + i % 97 + 3 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens,
                  ignore_eos=True), max_tokens, BS, priority=priority)
    s.add_request(req)
    return req


class FakeRunner:
    """Tracks computed tokens like a model runner and returns token 1 for every request that samples."""

    def __init__(self):
        self.computed: dict[str, int] = {}
        self.known: dict[str, int] = {}

    def __call__(self, so: SchedulerOutput, s: Scheduler) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.computed[new.req_id] = new.num_computed_tokens
            self.known[new.req_id] = len(new.token_ids)
        for c in so.scheduled_cached_reqs:
            assert self.computed[c.req_id] == c.num_computed_tokens
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
            ids.append(rid)
            done = self.computed[rid] >= self.known[rid]
            sampled.append([1] if done else [])
            if done:
                self.known[rid] += 1
        return ModelRunnerOutput(ids, sampled)


def run_to_completion(s: Scheduler, runner: FakeRunner, max_steps=1000, check=None):
    outputs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outputs
        so = s.schedule()
        if check:
            check(so)
        outputs += s.update_from_output(so, runner(so, s))
    raise AssertionError("did not finish")


def test_budgets_are_never_exceeded():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=40, budget=24, max_seqs=5)
    for i in range(30):
        add(s, f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 12), base=i * 100)

    def check(so):
        assert so.total_num_scheduled_tokens <= 24
        assert len(so.num_scheduled_tokens) <= 5
        assert len(s.running) <= 5

    outputs = run_to_completion(s, FakeRunner(), check=check)
    finished = {o.request_id for o in outputs if o.finished}
    assert finished == {f"r{i}" for i in range(30)}
    assert s.kv_cache_manager.pool.num_free_blocks == 40


def test_long_prompt_is_chunked():
    s = make_scheduler(budget=16)
    add(s, "long", 50)
    steps = []
    runner = FakeRunner()
    while s.has_unfinished_requests():
        so = s.schedule()
        steps.append(so.num_scheduled_tokens.get("long", 0))
        s.update_from_output(so, runner(so, s))
    assert steps[:4] == [16, 16, 16, 2] and steps[4:] == [1, 1, 1]


def test_decodes_go_first():
    s = make_scheduler(budget=10)
    add(s, "a", 3, max_tokens=10)
    runner = FakeRunner()
    so = s.schedule()
    s.update_from_output(so, runner(so, s))
    add(s, "b", 30, base=500)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}


def test_long_prefill_token_threshold_caps_each_prompts_chunk():
    """With the cap at 12, two prompts arriving together take 12 tokens each a step (within the budget of 32)
    while a decoding request keeps its token every step; without it, the first prompt fills the budget."""
    import dataclasses

    for cap, first_step in [(12, {"a": 1, "b": 12, "c": 12}), (0, {"a": 1, "b": 31})]:
        s = make_scheduler(budget=32)
        s.config = dataclasses.replace(s.config, long_prefill_token_threshold=cap)
        add(s, "a", 3, max_tokens=20)
        runner = FakeRunner()
        so = s.schedule()
        s.update_from_output(so, runner(so, s))
        add(s, "b", 40, base=500)
        add(s, "c", 30, base=700)
        so = s.schedule()
        assert so.num_scheduled_tokens == first_step
        s.update_from_output(so, runner(so, s))
        if cap:
            so = s.schedule()
            assert so.num_scheduled_tokens == {"a": 1, "b": 12, "c": 12}


def test_prompt_tokens_are_capped_while_requests_decode():
    """prefill_tokens_while_decoding 8 in a budget of 32: with "a" decoding, the step's prompt tokens (running
    chunks and new requests together) stop at 8 and "a" keeps its token; once nothing decodes, a prompt takes the
    whole budget again."""
    import dataclasses

    s = make_scheduler(budget=32)
    s.config = dataclasses.replace(s.config, prefill_tokens_while_decoding=8)
    add(s, "b", 40, base=500)
    runner = FakeRunner()
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 32}   # nothing decodes yet: the whole budget
    s.update_from_output(so, runner(so, s))
    add(s, "c", 60, base=700)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 8, "c": 24}   # both in their prompts: still the whole budget
    s.update_from_output(so, runner(so, s))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 1, "c": 8}   # b decodes: c's chunk is capped
    s.update_from_output(so, runner(so, s))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 1, "c": 8}
    s.update_from_output(so, runner(so, s))
    outputs = run_to_completion(s, runner)
    assert {o.request_id for o in outputs if o.finished} == {"b", "c"}


def test_preemption_then_resume():
    s = make_scheduler(num_blocks=6, budget=64, max_seqs=4)
    add(s, "old", 8, max_tokens=8)
    add(s, "new", 8, max_tokens=8, base=300)
    runner = FakeRunner()
    preempted_seen = set()

    def check(so):
        preempted_seen.update(so.preempted_req_ids)

    outputs = run_to_completion(s, runner, check=check)
    assert s.num_preemptions >= 1 and preempted_seen == {"new"}, "the newest request is preempted"
    done = {o.request_id: o for o in outputs if o.finished}
    assert set(done) == {"old", "new"} and all(o.finish_reason == "length" for o in done.values())
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "new") == 8
    assert s.kv_cache_manager.pool.num_free_blocks == 6


def test_priority_policy_preempts_lowest_priority():
    s = make_scheduler(num_blocks=6, budget=64, max_seqs=4, policy="priority")
    add(s, "important", 8, max_tokens=8, priority=0)
    add(s, "background", 8, max_tokens=8, priority=5, base=300)
    seen = set()
    run_to_completion(s, FakeRunner(), check=lambda so: seen.update(so.preempted_req_ids))
    assert seen == {"background"}


def test_priority_queue_order():
    s = make_scheduler(budget=4, max_seqs=1, policy="priority")
    add(s, "late", 4, priority=3)
    add(s, "urgent", 4, priority=-1, base=200)
    assert list(s.schedule().num_scheduled_tokens) == ["urgent"]


def test_pool_is_free_after_mixed_finish_and_abort():
    rng = random.Random(3)
    s = make_scheduler(num_blocks=30, budget=20, max_seqs=6)
    runner = FakeRunner()
    for i in range(25):
        add(s, f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 10), base=(i % 3) * 7)
    for step in range(400):
        if not s.has_unfinished_requests():
            break
        if step % 5 == 2:
            live = list(s.requests)
            s.finish_requests(rng.sample(live, k=min(2, len(live))), RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        s.update_from_output(so, runner(so, s))
    assert not s.has_unfinished_requests()
    pool = s.kv_cache_manager.pool
    assert pool.num_free_blocks == 30 and all(b.ref_cnt == 0 for b in pool.blocks)
    assert s.kv_cache_manager.req_to_blocks == {}


def test_prefix_cache_hit_in_scheduler():
    s = make_scheduler(budget=64)
    runner = FakeRunner()
    add(s, "first", 20)
    run_to_completion(s, runner)
    add(s, "second", 22)
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20 and so.num_scheduled_tokens["second"] == 2


def test_block_runs_keep_table_order():
    from tokenmill.engine.engine_core import block_runs

    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []


def test_at_most_max_loras_adapters_run_at_once():
    """With max_loras=2, a request whose adapter would be the third waits (skipped, not blocking): base-model and
    same-adapter requests behind it are admitted; it runs once an adapter's requests are done, first in line."""
    from tokenmill.lora.request import LoRARequest

    s = Scheduler(SchedulerConfig(64, 8, 256, True, "fcfs", max_loras=2), CacheConfig(BS, 64, True))
    a, b, c = (LoRARequest(n, i + 1, "/x") for i, n in enumerate("abc"))
    plan = [("r1", a), ("r2", b), ("r3", c), ("r4", None), ("r5", a), ("r6", c)]
    for rid, lora in plan:
        s.add_request(Request(rid, [5 + int(rid[1])] * 6, SamplingParams(max_tokens=2, ignore_eos=True), 2, BS,
                              lora_request=lora))
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r1", "r2", "r4", "r5"]
    assert [n.lora_request for n in so.scheduled_new_reqs] == [a, b, None, a]
    assert [r.request_id for r in s.waiting] == ["r3", "r6"]
    s.finish_requests(["r2"], RequestStatus.FINISHED_STOPPED)   # adapter b's only request: c takes its place
    s.update_from_output(so, ModelRunnerOutput([], []))
    assert [n.req_id for n in s.schedule().scheduled_new_reqs] == ["r3", "r6"]


def test_between_forwards_counts_host_time_but_not_an_idle_wait(monkeypatch):
    import tokenmill.profiling as profiling

    clock = [100.0]
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])   # a fake clock: no sleeps to race
    p = profiling.StepProfile()
    p.model_start()
    clock[0] += 0.5              # a forward
    p.model_done()
    clock[0] += 0.02
    p.model_start()              # 20 ms of host time between two forwards
    clock[0] += 0.5
    p.model_done()
    p.idle()                     # nothing to run: the wait below is not counted
    clock[0] += 5.0
    p.model_start()
    clock[0] += 0.5
    p.model_done()
    clock[0] += 0.03
    p.model_start()              # and counting resumes after it
    assert abs(p.seconds["between_forwards"] - 0.05) < 1e-9


def test_the_server_caps_prompt_tokens_while_decoding_by_default_and_offline_does_not():
    """`tokenmill serve` with the flag unset gets SERVER_PREFILL_TOKENS_WHILE_DECODING; an explicit value (0
    included) stays; offline (LLM) leaves it uncapped."""
    from tokenmill.cli.args import engine_args_from
    from tokenmill.cli.main import build_parser
    from tokenmill.config import SERVER_PREFILL_TOKENS_WHILE_DECODING, EngineArgs
    from tokenmill.engine.create_config import create_engine_config
    from tokenmill.entrypoints.openai.server import server_engine_args

    def served(*flags: str) -> int:
        return server_engine_args(engine_args_from(build_parser().parse_args(["serve", *flags])))\
            .prefill_tokens_while_decoding

    assert served() == SERVER_PREFILL_TOKENS_WHILE_DECODING > 0
    assert served("--prefill-tokens-while-decoding", "0") == 0
    assert served("--prefill-tokens-while-decoding", "96") == 96
    assert create_engine_config(EngineArgs()).scheduler_config.prefill_tokens_while_decoding == 0
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding must be 0 .no cap. or positive, got -1"):
        create_engine_config(EngineArgs(prefill_tokens_while_decoding=-1))


def test_a_prompt_waits_until_all_of_it_fits():
    """With room for its first chunk but not its whole prompt, a request waits: admitted on the chunk's room, its
    later chunks would find no free blocks and a preemption would throw work away. It starts once the blocks are
    back, and nothing is preempted."""
    s = make_scheduler(num_blocks=8, budget=8, max_seqs=4)
    add(s, "first", 16, max_tokens=4)          # 4 blocks of 4 tokens, 5 once it decodes
    runner = FakeRunner()
    for _ in range(2):                         # its prompt in two chunks of 8
        so = s.schedule()
        s.update_from_output(so, runner(so, s))
    add(s, "long", 16, max_tokens=4, base=300)  # needs 4 blocks: 3 are free, its first 8-token chunk needs 2
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"first"} and s.kv_cache_manager.pool.num_free_blocks == 3
    s.update_from_output(so, runner(so, s))
    seen = set()
    outputs = run_to_completion(s, runner, check=lambda so: seen.update(so.preempted_req_ids))
    assert not seen and s.num_preemptions == 0
    assert {o.request_id for o in outputs if o.finished} == {"first", "long"}
