"""The autoscaler without processes: the policy's decisions on a fake clock (Ray Serve's rules: desired =
ongoing / target per replica in [min, max], changes held for their delays, a cold start at once), the scaler
acting on them through a fake launcher (drain before stop, a dead replica replaced), the proxy holding requests
while no replica is up, and the prefix choice keeping each prompt's home while replicas come and go."""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenmill.router.autoscaler import Autoscaler
from tokenmill.router.backends import Backend, BackendPool
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Router
from tokenmill.router.proxy import Proxy
from tokenmill.router.scaling_policy import AutoscalingConfig, ScalingPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _config(**kw) -> AutoscalingConfig:
    base = dict(min_replicas=0, max_replicas=3, target_ongoing_requests=4, upscale_delay=10, downscale_delay=60,
                downscale_to_zero_delay=300)
    return AutoscalingConfig(**{**base, **kw})


def test_desired_is_ongoing_over_the_target_within_min_and_max():
    policy = ScalingPolicy(_config(min_replicas=1))
    assert [policy.desired(n) for n in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 3]


def test_a_first_replica_starts_at_once_for_a_waiting_request():
    policy = ScalingPolicy(_config())
    assert policy.decide(0.0, current=0, ongoing=0).target == 0
    d = policy.decide(0.1, current=0, ongoing=1)
    assert (d.target, d.reason) == (1, "cold_start")
    assert policy.decide(0.2, current=0, ongoing=9).target == 3   # a burst on zero: all it needs at once


def test_upscale_waits_for_its_delay_and_a_dip_restarts_the_wait():
    policy = ScalingPolicy(_config())
    assert policy.decide(0, 1, 8).target == 1
    assert policy.decide(9.9, 1, 8).reason == "waiting"
    assert policy.decide(10, 1, 8).target == 2
    assert policy.decide(20, 2, 12).target == 2          # asks for 3: its own wait starts now
    assert policy.decide(25, 2, 4).target == 2           # the load fell back: steady, the wait is over
    assert policy.decide(31, 2, 12).target == 2          # asks again: a new wait, from 31
    assert policy.decide(41, 2, 12).target == 3


def test_down_to_zero_goes_through_one_with_its_own_delay():
    policy = ScalingPolicy(_config())
    assert policy.decide(0, 3, 0).target == 3
    d = policy.decide(60, 3, 0)
    assert (d.desired, d.target, d.reason) == (0, 1, "downscale")   # not straight to 0
    assert policy.decide(100, 1, 0).target == 1
    assert policy.decide(399, 1, 0).target == 1
    d = policy.decide(400, 1, 0)
    assert (d.target, d.reason) == (0, "downscale_to_zero")


def test_min_replicas_is_a_floor():
    policy = ScalingPolicy(_config(min_replicas=2))
    assert policy.decide(0, 2, 0).target == 2 and policy.decide(1000, 2, 0).target == 2


@pytest.mark.parametrize("kw, flag", [
    (dict(min_replicas=-1), "--min-replicas"), (dict(max_replicas=0), "--max-replicas"),
    (dict(min_replicas=3, max_replicas=2), "--max-replicas"), (dict(initial_replicas=5), "--initial-replicas"),
    (dict(target_ongoing_requests=0), "--target-ongoing-requests"), (dict(upscale_delay=-1), "--upscale-delay"),
    (dict(downscale_to_zero_delay=-2), "--downscale-to-zero-delay"), (dict(queue_timeout=-1), "--queue-timeout")])
def test_bad_settings_are_errors_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        _config(**kw)


class FakeLauncher:
    """Replicas that are 'processes' in a dict; `stopped` lists what was stopped, and when (the replica's in-flight
    count then)."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool, self.alive_urls, self.stopped, self.n = pool, set(), [], 0

    def start(self) -> str:
        self.n += 1
        url = f"http://10.0.0.{self.n}:8000"
        self.alive_urls.add(url)
        return url

    def stop(self, url: str) -> None:
        self.stopped.append((url, self.pool.backends[url].outstanding))
        self.alive_urls.discard(url)

    def alive(self, url: str) -> bool:
        return url in self.alive_urls

    def stop_all(self) -> None:
        self.alive_urls.clear()


def _scaler(**kw) -> tuple[Autoscaler, FakeLauncher, Clock]:
    pool, clock = BackendPool([]), Clock()
    launcher = FakeLauncher(pool)
    return Autoscaler(pool, launcher, _config(**kw), RouterMetrics(), clock), launcher, clock


def _come_up(scaler: Autoscaler) -> None:
    for b in scaler.pool.backends.values():
        b.healthy = True


async def _two_up(**kw) -> tuple[Autoscaler, FakeLauncher, Clock]:
    """A scaler with two replicas started and healthy."""
    scaler, launcher, clock = _scaler(**kw)
    await scaler._start_one()
    await scaler._start_one()
    _come_up(scaler)
    return scaler, launcher, clock


def test_the_scaler_starts_on_held_requests_and_drains_before_it_stops():
    async def scenario():
        scaler, launcher, clock = _scaler(downscale_delay=5, downscale_to_zero_delay=5)
        assert (await scaler.step()).target == 0 and not scaler.pool.backends
        scaler.held.count = 1                       # a request waits on zero replicas
        await scaler.step()
        (first,) = scaler.pool.backends.values()
        assert first.state == "starting" and not first.routable
        _come_up(scaler)
        scaler.held.count, first.outstanding = 0, 9   # it went through; a burst follows
        await scaler.step()
        clock.now = 10
        await scaler.step()
        assert len(scaler.active()) == 3 and scaler.metrics.current_replicas._value.get() == 3
        _come_up(scaler)
        first.outstanding = 1                       # the burst is over: one request still in flight on `first`
        clock.now = 20
        await scaler.step()
        clock.now = 25
        await scaler.step()                         # 3 -> 1: the two idle ones drain and stop
        await asyncio.sleep(0.2)
        assert [b.url for b in scaler.active()] == [first.url] and len(launcher.stopped) == 2
        assert all(in_flight == 0 for _, in_flight in launcher.stopped)
        first.outstanding = 0
        clock.now = 30
        await scaler.step()
        clock.now = 35
        await scaler.step()                         # idle past the to-zero delay
        assert first.draining and first.state == "draining"
        await asyncio.sleep(0.2)
        assert not scaler.pool.backends and not launcher.alive_urls and scaler.status()["current_replicas"] == 0

    asyncio.run(scenario())


def test_a_draining_replica_is_stopped_only_after_its_last_request():
    async def scenario():
        scaler, launcher, clock = await _two_up(min_replicas=1, initial_replicas=2, downscale_delay=0)
        busy = scaler.active()[1]
        scaler.active()[0].outstanding, busy.outstanding = 3, 1
        # ongoing 4 -> 1 replica; the less busy (newer) one drains
        await scaler.step()
        assert busy.draining and not launcher.stopped
        await asyncio.sleep(0.2)
        assert not launcher.stopped                 # its request has not finished
        busy.outstanding = 0
        await asyncio.sleep(0.2)
        assert launcher.stopped == [(busy.url, 0)] and busy.url not in scaler.pool.backends

    asyncio.run(scenario())


def test_a_draining_replica_takes_requests_again_when_the_load_comes_back():
    async def scenario():
        scaler, launcher, clock = await _two_up(min_replicas=1, downscale_delay=0, upscale_delay=0)
        first, second = scaler.active()
        first.outstanding, second.outstanding = 2, 1
        await scaler.step()                      # 3 ongoing: one replica is enough; `second` drains
        assert second.draining
        second.outstanding, first.outstanding = 1, 8   # a burst while its last request still runs
        await scaler.step()
        assert not second.draining and second.routable and launcher.n == 2 and not launcher.stopped
        second.outstanding = 0
        await asyncio.sleep(0.2)
        assert not launcher.stopped              # its drain was called off

    asyncio.run(scenario())


def test_a_replica_that_died_is_replaced():
    async def scenario():
        scaler, launcher, _ = _scaler(min_replicas=1)
        await scaler._start_one()
        dead = scaler.replicas[0]
        launcher.alive_urls.clear()
        await scaler.step()
        assert dead not in scaler.pool.backends and len(scaler.active()) == 1 and scaler.replicas[0] != dead

    asyncio.run(scenario())


def test_the_proxy_holds_a_request_until_a_replica_is_up_then_bounds_the_wait():
    async def scenario():
        scaler, _, _ = _scaler(queue_timeout=0.3, max_queued_requests=1)
        proxy = Proxy(scaler.pool, None, Router(), metrics=scaler.metrics, scaler=scaler)
        waiter = asyncio.create_task(proxy.wait_for_replica())
        await asyncio.sleep(0.1)
        assert scaler.held.count == 1 and scaler.ongoing() == 1
        full = await proxy.wait_for_replica()        # the queue (1) is full
        assert "already wait" in full
        scaler.pool.add(Backend("http://10.0.0.9:8000", healthy=True))
        assert await waiter is None and scaler.held.count == 0
        scaler.pool.remove("http://10.0.0.9:8000")
        assert "within 0.3 s" in await proxy.wait_for_replica()   # none comes: a bounded wait
        assert scaler.held.count == 0 and scaler.held.timeouts == 1

    asyncio.run(scenario())


def _closed_loop(router: Router, backends: list[Backend], keys: list[bytes], steps: int, seed: int = 0) -> dict:
    """`bench serve --num-prefixes 4 --max-concurrency 4`: 4 requests in flight, each with one of the keys at random;
    they finish in random order, and each that finishes lets the next one in. Returns each key's count of requests
    per replica."""
    rng = random.Random(seed)
    counts: dict = {k: {} for k in keys}
    in_flight = []
    for k in keys:
        b = router.choose(backends, k).backend
        b.outstanding += 1
        in_flight.append((k, b))
    for _ in range(steps):
        _, b = in_flight.pop(rng.randrange(len(in_flight)))
        b.outstanding -= 1
        k = rng.choice(keys)
        nb = router.choose(backends, k).backend
        nb.outstanding += 1
        in_flight.append((k, nb))
        counts[k][nb.url] = counts[k].get(nb.url, 0) + 1
    return counts


def test_four_system_prompts_at_concurrency_four_each_stay_on_one_replica():
    for seed in range(20):
        rng = random.Random(seed)
        backends = [Backend(f"http://10.0.0.{i}:8000", healthy=True) for i in range(2)]
        counts = _closed_loop(Router(), backends, [rng.randbytes(16) for _ in range(4)], 400, seed)
        assert all(len(per_replica) == 1 for per_replica in counts.values()), (seed, counts)


def test_a_new_replica_takes_new_prompts_and_leaves_the_old_ones_home():
    rng = random.Random(1)
    backends = [Backend(f"http://10.0.0.{i}:8000", healthy=True) for i in range(2)]
    router, old = Router(), [rng.randbytes(16) for _ in range(40)]
    homes = {k: router.choose(backends, k).backend.url for k in old}
    for b in backends:
        b.outstanding = 4            # both carry load when the third joins
    backends.append(Backend("http://10.0.0.2:8000", healthy=True))
    assert {k: router.choose(backends, k).backend.url for k in old} == homes
    new = [router.choose(backends, rng.randbytes(16)).backend.url for _ in range(4)]
    assert new == ["http://10.0.0.2:8000"] * 4


def test_the_router_shows_the_fleet_on_its_page_backends_metrics_and_the_grafana_board():
    """Scaled to zero, the router is healthy; /router/backends and /metrics carry the autoscaler's counts, and
    every tokenmill_router series the Grafana board's router panels query is one the router exports."""
    import json
    import re
    from pathlib import Path

    from fastapi.testclient import TestClient

    from tokenmill.router.app import build_router_app

    scaler, _, _ = _scaler()
    scaler.pool.add(Backend("http://10.0.0.7:8000", starting=True))
    with TestClient(build_router_app(scaler.pool, None, scaler=scaler)) as client:
        assert client.get("/health").status_code == 200
        page = client.get("/")
        assert page.status_code == 200 and "/router/backends" in page.text
        body = client.get("/router/backends").json()
        assert body["backends"][0]["state"] == "starting"
        assert body["autoscaling"]["max_replicas"] == 3 and body["autoscaling"]["current_replicas"] == 0
        scaler.metrics.scaling_decisions.labels("up")
        exported = {line.split("{")[0].split(" ")[0] for line in client.get("/metrics").text.splitlines()
                    if line.startswith("tokenmill_router:")}
    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())
    named = {m for p in dashboard["panels"] for t in p["targets"]
             for m in re.findall(r"tokenmill_router:[a-z0-9_]+", t["expr"])}
    assert {"tokenmill_router:desired_replicas", "tokenmill_router:current_replicas"} <= named
    assert named <= exported, named - exported
