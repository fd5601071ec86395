"""What the live engine view shows besides the engine's own snapshot: the last minute of activity, kept by the
front end from the stats and outputs it already receives (nothing extra is asked of the engine)."""

from __future__ import annotations

import collections
import time

WINDOW_S = 60.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class RecentActivity:
    def __init__(self, window: float = WINDOW_S, cost_per_hour: float | None = None):
        self.window = window
        self.cost_per_hour = cost_per_hour
        self.steps: collections.deque = collections.deque()      # (time, prompt, generated, queries, hits, preempted)
        self.finished: collections.deque = collections.deque()   # (time, ttft, mean inter-token latency or None)

    def _prune(self, now: float) -> None:
        for q in (self.steps, self.finished):
            while q and q[0][0] < now - self.window:
                q.popleft()

    def record_engine(self, outputs) -> None:
        """A stat observer: each engine message's counters (deltas since its previous one)."""
        s = outputs.scheduler_stats
        if s is None:
            return
        now = time.time()
        self.steps.append((now, s.num_prompt_tokens, s.num_generation_tokens, s.prefix_cache_queries,
                           s.prefix_cache_hits, s.num_preemptions))
        self._prune(now)

    def record_output(self, ro) -> None:
        """An output observer: a finished request's time to first token and mean gap between its tokens."""
        m = ro.metrics
        if not ro.finished or m is None or m.first_token_time is None or m.finished_time is None:
            return
        n = m.num_output_tokens // max(1, len(ro.outputs))   # per completion (n > 1 run side by side)
        itl = (m.finished_time - m.first_token_time) / (n - 1) if n > 1 else None
        self.finished.append((m.finished_time, m.first_token_time - m.arrival_time, itl))

    def summary(self) -> dict:
        now = time.time()
        self._prune(now)
        span = self.window
        totals = [sum(x[i] for x in self.steps) for i in range(1, 6)]
        ttfts = [x[1] for x in self.finished]
        itls = [x[2] for x in self.finished if x[2] is not None]
        cost = self.cost_per_hour * span / 3600 / totals[1] * 1e6 if self.cost_per_hour is not None and totals[1] \
            else None   # the machine's cost over the minute, per million tokens it generated
        return {"window_s": span, "prompt_tokens_per_s": totals[0] / span, "generation_tokens_per_s": totals[1] / span,
                "cost_usd_per_million_output_tokens": cost,
                "prefix_cache_hit_rate": totals[3] / totals[2] if totals[2] else None, "preemptions": totals[4],
                "requests_finished": len(self.finished),
                "ttft_s": {"p50": _percentile(ttfts, 0.5), "p99": _percentile(ttfts, 0.99)},
                "itl_s": {"p50": _percentile(itls, 0.5), "p99": _percentile(itls, 0.99)}}
