"""Priority that displaces: a waiting request of higher priority preempts running lower-priority ones when a
sequence slot, KV memory or the step's token budget is short; equals never displace each other; nothing is lost."""

from __future__ import annotations

from test_scheduler import FakeRunner, add, make_scheduler

from tokenmill.core.scheduler import Scheduler


def step(s: Scheduler, runner: FakeRunner, outputs: list, preempted: list | None = None):
    so = s.schedule()
    if preempted is not None:
        preempted.extend(sorted(so.preempted_req_ids))
    outputs += s.update_from_output(so, runner(so, s))
    return so


def drain(s: Scheduler, runner: FakeRunner, outputs: list, preempted: list, max_steps: int = 500) -> list[str]:
    """Runs to the end; returns the request ids in the order they finished."""
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return [o.request_id for o in outputs if o.finished]
        step(s, runner, outputs, preempted)
    raise AssertionError("did not finish")


def tokens_of(outputs, rid: str) -> int:
    return sum(len(o.new_token_ids) for o in outputs if o.request_id == rid)


def low_then_high(policy: str):
    """7 blocks of 4 tokens: "low" holds 5 of them after 3 steps; then "high" arrives, needing 3, so it would wait
    for low to end. Returns the scheduler, its runner, outputs and preemptions so far."""
    s = make_scheduler(num_blocks=7, budget=64, max_seqs=4, policy=policy)
    runner, outputs, preempted = FakeRunner(), [], []
    add(s, "low", 16, max_tokens=8, priority=5)
    for _ in range(3):
        step(s, runner, outputs, preempted)
    add(s, "high", 12, max_tokens=4, priority=0, base=300)
    return s, runner, outputs, preempted


def test_high_priority_displaces_for_kv_memory():
    s, runner, outputs, preempted = low_then_high("priority")
    so = step(s, runner, outputs, preempted)
    assert so.preempted_req_ids == {"low"} and "high" in so.num_scheduled_tokens
    order = drain(s, runner, outputs, preempted)
    assert order == ["high", "low"]
    assert tokens_of(outputs, "low") == 8 and tokens_of(outputs, "high") == 4   # nothing lost, nothing twice
    assert preempted == ["low"]
    assert s.kv_cache_manager.pool.num_free_blocks == 7


def test_high_priority_displaces_for_a_sequence_slot():
    s = make_scheduler(num_blocks=64, budget=64, max_seqs=2, policy="priority")
    runner, outputs, preempted = FakeRunner(), [], []
    add(s, "low-a", 4, max_tokens=20, priority=3)
    add(s, "low-b", 4, max_tokens=20, priority=1, base=100)
    step(s, runner, outputs, preempted)
    add(s, "high", 4, max_tokens=2, priority=0, base=200)
    so = step(s, runner, outputs, preempted)
    assert so.preempted_req_ids == {"low-a"}   # the lowest priority goes, not the newest
    assert drain(s, runner, outputs, preempted)[0] == "high"
    assert all(tokens_of(outputs, r) == n for r, n in (("low-a", 20), ("low-b", 20), ("high", 2)))


def test_high_priority_displaces_for_the_token_budget():
    # a 16-token budget spent on low's long prompt chunks: high's 8-token prompt would wait for 3 more steps
    s = make_scheduler(num_blocks=64, budget=16, max_seqs=4, policy="priority")
    runner, outputs, preempted = FakeRunner(), [], []
    add(s, "low", 64, max_tokens=2, priority=2)
    step(s, runner, outputs, preempted)
    add(s, "high", 8, max_tokens=2, priority=0, base=300)
    so = step(s, runner, outputs, preempted)
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens["high"] == 8
    assert drain(s, runner, outputs, preempted) == ["high", "low"]
    assert tokens_of(outputs, "low") == 2


def test_room_to_spare_displaces_nobody():
    s = make_scheduler(num_blocks=64, budget=64, max_seqs=4, policy="priority")
    runner, outputs, preempted = FakeRunner(), [], []
    add(s, "low", 8, max_tokens=8, priority=5)
    step(s, runner, outputs, preempted)
    add(s, "high", 8, max_tokens=8, priority=0, base=300)
    drain(s, runner, outputs, preempted)
    assert preempted == []


def test_equal_priorities_never_displace_each_other():
    s = make_scheduler(num_blocks=10, budget=16, max_seqs=2, policy="priority")
    runner, outputs, preempted = FakeRunner(), [], []
    for i in range(6):
        add(s, f"r{i}", 12, max_tokens=6, priority=1, base=i * 50)
        step(s, runner, outputs, preempted)
    order = drain(s, runner, outputs, preempted)
    assert preempted == [] and order == [f"r{i}" for i in range(6)]   # first come, first served among equals


def test_fcfs_policy_ignores_priority():
    s, runner, outputs, preempted = low_then_high("fcfs")
    assert drain(s, runner, outputs, preempted) == ["low", "high"] and preempted == []


def test_three_levels_finish_in_priority_order_and_each_victim_once_per_arrival():
    s = make_scheduler(num_blocks=9, budget=32, max_seqs=4, policy="priority")
    runner, outputs, preempted = FakeRunner(), [], []
    add(s, "p9", 16, max_tokens=10, priority=9)
    step(s, runner, outputs, preempted)
    add(s, "p5", 16, max_tokens=10, priority=5, base=100)
    step(s, runner, outputs, preempted)
    add(s, "p0", 16, max_tokens=10, priority=0, base=200)
    order = drain(s, runner, outputs, preempted)
    assert order == ["p0", "p5", "p9"]
    assert preempted.count("p5") <= 1 and "p0" not in preempted
    assert all(tokens_of(outputs, r) == 10 for r in ("p0", "p5", "p9"))
    assert s.kv_cache_manager.pool.num_free_blocks == 9
