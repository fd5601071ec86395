"""The fleet following the load: every `interval` seconds the autoscaler counts the requests on the replicas it
launched (the router's in-flight count, or the replica's own queue when that is larger) plus the requests the router
holds for lack of a replica, asks the policy for a target, and starts replicas through the launcher or drains some
(no new requests; stopped once their in-flight ones finished, so none is dropped). It sits beside the pool: the
proxy only reads `pool.routable()`, and holds requests in `held` while none is in rotation."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tokenmill.router.backends import Backend, BackendPool
from tokenmill.router.launcher import ReplicaLauncher
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.scaling_policy import AutoscalingConfig, ScalingDecision, ScalingPolicy
from tokenmill.utils import init_logger

logger = init_logger(__name__)


@dataclass
class HeldRequests:
    """Requests the proxy holds while no replica is in rotation (the scaler counts them as load)."""
    count: int = 0
    timeouts: int = 0


class Autoscaler:
    def __init__(self, pool: BackendPool, launcher: ReplicaLauncher, config: AutoscalingConfig,
                 metrics: RouterMetrics | None = None, clock=time.monotonic):
        self.pool, self.launcher, self.config = pool, launcher, config
        self.policy = ScalingPolicy(config)
        self.metrics, self.clock = metrics, clock
        self.held = HeldRequests()
        self.replicas: list[str] = []       # the URLs it launched and has not stopped, oldest first
        self.draining: set[str] = set()
        self.last = ScalingDecision(config.initial_replicas, config.initial_replicas, "initial")
        self._drains: dict[str, asyncio.Task] = {}   # url -> its drain (cancelled if the load comes back)
        self._stopping: set[str] = set()             # drained, being stopped: past taking requests again

    def active(self) -> list[Backend]:
        return [self.pool.backends[u] for u in self.replicas if u not in self.draining and u in self.pool.backends]

    def ongoing(self) -> float:
        return sum(max(b.outstanding, b.waiting) for b in self.active()) + self.held.count

    def status(self) -> dict:
        c = self.config
        return {"min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
                "target_ongoing_requests": c.target_ongoing_requests, "desired_replicas": self.last.desired,
                "target_replicas": self.last.target, "current_replicas": len(self.active()),
                "draining_replicas": len(self.draining), "ongoing_requests": self.ongoing(),
                "queued_requests": self.held.count, "last_decision": self.last.reason}

    async def step(self) -> ScalingDecision:
        """One decision, acted on; launcher calls (which block) run in a thread."""
        self._reap_dead()
        current = len(self.active())
        decision = self.policy.decide(self.clock(), current, self.ongoing())
        if decision.target != current:
            logger.info("scaling %d -> %d replica(s) (%s: %.0f requests ongoing, %g per replica targeted)",
                        current, decision.target, decision.reason, self.ongoing(),
                        self.config.target_ongoing_requests)
            if self.metrics is not None:
                self.metrics.scaling_decisions.labels("up" if decision.target > current else "down").inc()
        for _ in range(decision.target - current):
            if not self._undrain_one():
                await self._start_one()
        if decision.target < current:
            for b in self._to_drain(current - decision.target):
                self._begin_drain(b)
        self.last = decision
        if self.metrics is not None:
            self.metrics.desired_replicas.set(decision.desired)
            self.metrics.current_replicas.set(len(self.active()))
            self.metrics.queued_requests.set(self.held.count)
        return decision

    async def _start_one(self) -> None:
        try:
            url = await asyncio.to_thread(self.launcher.start)
        except Exception as e:  # noqa: BLE001 - a failed launch is logged and retried on the next decision
            logger.error("could not start a replica: %s", e)
            return
        self.pool.add(Backend(url, starting=True))
        self.replicas.append(url)

    def _to_drain(self, n: int) -> list[Backend]:
        """The least busy first; among equals, the newest (the oldest hold the warmest prefix caches)."""
        active = self.active()
        order = sorted(range(len(active)), key=lambda i: (active[i].outstanding + active[i].waiting, -i))
        return [active[i] for i in order[:n]]

    def _begin_drain(self, b: Backend) -> None:
        b.draining = True
        self.draining.add(b.url)
        logger.info("draining replica %s (%d requests in flight)", b.url, b.outstanding)
        task = asyncio.get_running_loop().create_task(self._drain_and_stop(b))
        self._drains[b.url] = task
        task.add_done_callback(lambda t: self._drains.pop(b.url) if self._drains.get(b.url) is t else None)

    def _undrain_one(self) -> bool:
        """The load came back while a replica still finishes its requests: it takes new ones again (warm, no cold
        start). False when none is draining or each is already stopping."""
        for url in [u for u in self.replicas if u in self.draining and u not in self._stopping]:
            task = self._drains.pop(url, None)
            if task is not None:
                task.cancel()
            self.draining.discard(url)
            self.pool.backends[url].draining = False
            logger.info("replica %s takes requests again (the load came back while it drained)", url)
            return True
        return False

    async def _drain_and_stop(self, b: Backend) -> None:
        while b.outstanding > 0:
            await asyncio.sleep(0.05)
        self._stopping.add(b.url)
        try:
            await asyncio.to_thread(self.launcher.stop, b.url)
        finally:
            self._stopping.discard(b.url)
        self._forget(b.url)

    def _forget(self, url: str) -> None:
        self.draining.discard(url)
        if url in self.replicas:
            self.replicas.remove(url)
        if url in self.pool.backends:
            self.pool.remove(url)

    def _reap_dead(self) -> None:
        """A replica whose process died leaves the fleet (and the pool); the next decisions replace it."""
        for url in [u for u in self.replicas if u not in self.draining and not self.launcher.alive(u)]:
            logger.warning("replica %s exited on its own: it leaves the fleet", url)
            self._forget(url)

    async def run(self) -> None:
        for _ in range(self.config.initial_replicas):
            await self._start_one()
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the scaler must outlive one bad decision
                logger.exception("autoscaler step failed")

    async def close(self) -> None:
        for task in list(self._drains.values()):
            task.cancel()
        await asyncio.to_thread(self.launcher.stop_all)
