"""How many replicas the load asks for, with Ray Serve's autoscaling names and rules: the desired count is the
requests in flight plus queued over `target_ongoing_requests` per replica, clipped to [min, max]; a change must hold
for its delay before it is taken (hysteresis), except a first replica for requests waiting on zero, which starts at
once. A leaf: no I/O, no clock of its own, so decisions are unit-tested on a fake clock."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AutoscalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None      # default: min_replicas
    target_ongoing_requests: float = 2.0     # per replica: in flight plus queued (Ray Serve's default)
    upscale_delay: float = 30.0              # seconds the load must ask for more before one starts
    downscale_delay: float = 600.0           # ... for fewer before one drains
    downscale_to_zero_delay: float | None = None   # ... from 1 to 0 (default: downscale_delay)
    interval: float = 0.5                    # seconds between decisions
    max_queued_requests: int = 256           # held in the router while no replica is in rotation
    queue_timeout: float = 120.0             # seconds one may wait there before a 503

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"--min-replicas must be 0 or more, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"--max-replicas must be at least 1 and at least --min-replicas ({self.min_replicas}), "
                             f"got {self.max_replicas}")
        if self.initial_replicas is None:
            self.initial_replicas = self.min_replicas
        if not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"--initial-replicas must lie in [--min-replicas, --max-replicas] = "
                             f"[{self.min_replicas}, {self.max_replicas}], got {self.initial_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"--target-ongoing-requests must be above 0, got {self.target_ongoing_requests}")
        if self.downscale_to_zero_delay is None:
            self.downscale_to_zero_delay = self.downscale_delay
        for name in ("upscale_delay", "downscale_delay", "downscale_to_zero_delay", "queue_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if not self.interval > 0:
            raise ValueError(f"the scaling interval must be above 0, got {self.interval}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must not be negative, got {self.max_queued_requests}")


@dataclass
class ScalingDecision:
    desired: int      # what the load asks for now, clipped to [min, max]
    target: int       # what the fleet should have now (desired once its delay has passed, else the current count)
    reason: str       # "steady", "cold_start", "below_min", "upscale", "downscale", "downscale_to_zero", "waiting"


class ScalingPolicy:
    """Remembers since when the load has asked for more (or fewer) replicas than there are."""

    def __init__(self, config: AutoscalingConfig):
        self.config = config
        self._up_since: float | None = None
        self._down_since: float | None = None

    def desired(self, ongoing: float) -> int:
        c = self.config
        return min(c.max_replicas, max(c.min_replicas, math.ceil(ongoing / c.target_ongoing_requests - 1e-9)))

    def decide(self, now: float, current: int, ongoing: float) -> ScalingDecision:
        """`current`: replicas started and not draining; `ongoing`: requests in flight on them plus those the
        router holds."""
        c = self.config
        desired = self.desired(ongoing)
        if current == 0 and ongoing > 0:
            self._up_since = self._down_since = None
            return ScalingDecision(desired, max(1, desired), "cold_start")
        if current < c.min_replicas:     # a replica died, or the fleet is starting: back to the floor at once
            self._up_since = self._down_since = None
            return ScalingDecision(desired, desired, "below_min")
        if desired > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since >= c.upscale_delay:
                self._up_since = None
                return ScalingDecision(desired, desired, "upscale")
            return ScalingDecision(desired, current, "waiting")
        if desired < current:
            self._up_since = None
            self._down_since = now if self._down_since is None else self._down_since
            to_zero = desired == 0 and current == 1
            target = desired if to_zero or desired > 0 else 1   # through 1 on the way to 0
            delay = c.downscale_to_zero_delay if to_zero else c.downscale_delay
            if now - self._down_since >= delay:
                self._down_since = None
                return ScalingDecision(desired, target, "downscale_to_zero" if to_zero else "downscale")
            return ScalingDecision(desired, current, "waiting")
        self._up_since = self._down_since = None
        return ScalingDecision(desired, current, "steady")
