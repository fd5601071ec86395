"""A load that changes over time (`bench serve --rate-schedule 20:0.5,30:6,60:0`) and what the fleet did under it:
the router's replica counts polled from /router/backends while the requests run, each request's start, TTFT and
latency, for `plot_timeline`."""

from __future__ import annotations

import asyncio
import time

import numpy as np


def parse_schedule(spec: str) -> list[tuple[float, float]]:
    """'SECONDS:RATE,...' -> [(seconds, requests/s)]; a rate of 0 is a quiet stretch (the fleet scales down)."""
    out = []
    for part in spec.split(","):
        try:
            seconds, rate = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--rate-schedule takes SECONDS:RATE pairs separated by commas, got {part!r}") from None
        if seconds <= 0 or rate < 0:
            raise ValueError(f"--rate-schedule: seconds must be above 0 and rates not negative, got {part!r}")
        out.append((seconds, rate))
    return out


def schedule_arrivals(schedule: list[tuple[float, float]], seed: int) -> list[float]:
    """Poisson arrival times (s from the start), each segment at its own rate."""
    rng, times, start = np.random.default_rng(seed), [], 0.0
    for seconds, rate in schedule:
        t = start
        while rate > 0:
            t += rng.exponential(1.0 / rate)
            if t >= start + seconds:
                break
            times.append(t)
        start += seconds
    return times


class FleetPoller:
    """Samples the router's /router/backends every `interval` s: (t, current, desired, held, in rotation)."""

    def __init__(self, session, base_url: str, headers: dict, t0: float, interval: float = 0.5):
        self.session, self.url, self.headers, self.t0, self.interval = session, base_url + "/router/backends", \
            headers, t0, interval
        self.samples: list[list[float]] = []

    async def run(self) -> None:
        while True:
            try:
                async with self.session.get(self.url, headers=self.headers) as r:
                    body = await r.json() if r.status == 200 else {}
            except Exception:  # noqa: BLE001 - not a router, or a blip: the sample is skipped
                body = {}
            scaling, backends = body.get("autoscaling") or {}, body.get("backends") or []
            if backends or scaling:
                self.samples.append([time.perf_counter() - self.t0, scaling.get("current_replicas", len(backends)),
                                     scaling.get("desired_replicas", len(backends)), scaling.get("queued_requests", 0),
                                     sum(1 for b in backends if b.get("healthy"))])
            await asyncio.sleep(self.interval)
