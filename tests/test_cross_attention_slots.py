"""The scheduler's cross-attention slots (an encoder-decoder model's second KV group), with fake requests: a
prompt starts only with a free slot and room in the step's encoder budget, holds its slot while it runs, and
gives it back when it finishes or is preempted."""

from __future__ import annotations

from test_scheduler import BS, FakeRunner

from tokenmill.config import CacheConfig, CrossAttentionConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams


def make(slots: int, budget_positions: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(64, 8, 128, True, "fcfs"), CacheConfig(BS, num_blocks, True),
                     cross_config=CrossAttentionConfig(slots, 1500, 1, budget_positions))


def add(s: Scheduler, rid: str, max_tokens: int = 3) -> Request:
    audio = MultiModalFeature("audio", rid.encode().hex().ljust(32, "0"), 0, 1, {})
    req = Request(rid, [50257, 50362], SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens, BS,
                  mm_features=[audio])
    s.add_request(req)
    return req


def test_prompts_wait_for_a_slot_and_take_it_back_when_done():
    s, runner = make(slots=2, budget_positions=3000), FakeRunner()
    reqs = [add(s, f"r{i}") for i in range(3)]
    so = s.schedule()
    assert set(so.scheduled_encoder_inputs) == {"r0", "r1"} and "r2" not in so.num_scheduled_tokens
    s.update_from_output(so, runner(so, s))
    while reqs[0].status == RequestStatus.RUNNING:
        so = s.schedule()
        assert "r2" not in so.num_scheduled_tokens   # both slots held until r0 and r1 finish
        s.update_from_output(so, runner(so, s))
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"r2": [0]}


def test_encoder_budget_starts_one_window_a_step():
    s, runner = make(slots=4, budget_positions=1500), FakeRunner()
    for i in range(3):
        add(s, f"r{i}")
    started = []
    for _ in range(3):
        so = s.schedule()
        started.append(sorted(so.scheduled_encoder_inputs))
        s.update_from_output(so, runner(so, s))
    assert started == [["r0"], ["r1"], ["r2"]]


def test_a_preempted_request_gives_its_slot_back_and_encodes_again():
    s = make(slots=2, budget_positions=3000)
    req = add(s, "r0")
    s.schedule()
    assert "r0" in s.encoder.holders
    s._preempt(req)   # (back to the front of the waiting queue)
    assert "r0" not in s.encoder.holders
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"r0": [0]}
