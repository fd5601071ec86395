"""The router's own Prometheus series: requests and retries per replica, routing decisions, affinity hits, the
replicas in rotation and their requests in flight, the prefill handoffs of disaggregated serving, and the
autoscaler's replica counts, decisions and held requests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.router.backends import BackendPool


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._gauged: set[str] = set()
        self.requests = Counter("tokenmill_router:requests", "Requests sent to each replica", ["backend"], registry=r)
        self.retries = Counter("tokenmill_router:retries", "Requests retried on another replica", registry=r)
        self.decisions = Counter("tokenmill_router:routing_decisions", "Routing decisions by kind", ["decision"],
                                 registry=r)
        self.affinity_hits = Counter("tokenmill_router:cache_affinity_hits",
                                     "Requests sent where the previous request with their prefix went", registry=r)
        self.unrouted = Counter("tokenmill_router:unrouted_requests", "Requests no replica could take (503)",
                                registry=r)
        self.healthy = Gauge("tokenmill_router:backend_healthy", "1 while a replica is in rotation", ["backend"],
                             registry=r)
        self.outstanding = Gauge("tokenmill_router:backend_outstanding", "Requests in flight on each replica",
                                 ["backend"], registry=r)
        self.prefills = Counter("tokenmill_router:prefill_requests", "Prompts computed on a prefill instance and "
                                "handed to a decode instance", ["backend"], registry=r)
        self.prefill_failures = Counter("tokenmill_router:prefill_failures", "Prefills that failed (the decode "
                                        "instance then computed the prompt itself)", registry=r)
        self.desired_replicas = Gauge("tokenmill_router:desired_replicas", "Replicas the load asks for (the "
                                      "autoscaler's target before its delays)", registry=r)
        self.current_replicas = Gauge("tokenmill_router:current_replicas", "Replicas started and not draining",
                                      registry=r)
        self.scaling_decisions = Counter("tokenmill_router:scaling_decisions", "Autoscaler changes of the replica "
                                         "count", ["direction"], registry=r)
        self.queued_requests = Gauge("tokenmill_router:queued_requests", "Requests the router holds while no "
                                     "replica is in rotation (a cold start)", registry=r)
        self.queue_timeouts = Counter("tokenmill_router:queue_timeouts", "Held requests answered 503 after "
                                      "waiting --queue-timeout seconds or finding the queue full", registry=r)

    def refresh(self, *pools: BackendPool) -> None:
        """The per-replica gauges now; a replica that left the pool (scaled down, removed) leaves them too."""
        urls = {b.url for pool in pools for b in pool.backends.values()}
        for gone in self._gauged - urls:
            self.healthy.remove(gone)
            self.outstanding.remove(gone)
        self._gauged = urls
        for b in (b for pool in pools for b in pool.backends.values()):
            self.healthy.labels(b.url).set(1 if b.routable else 0)
            self.outstanding.labels(b.url).set(b.outstanding)
