"""Where an engine step's time goes: scheduling, input preparation, forward, sampling, output processing.

Always on: a few perf_counter calls per step cost microseconds, and `bench throughput --profile` prints it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class StepProfile:
    PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update_from_output", "output_processing")

    # parts of another phase's time (forward), shown but not added into the total; between_forwards is the host's
    # time from one step's sampled tokens to the next step's forward (scheduling, inputs, outputs, the loop)
    NESTED = frozenset({"pp_recv", "pp_send", "all_reduce", "between_forwards"})

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._model_done: float | None = None

    def model_start(self) -> None:
        """A forward begins: the time since the last step's tokens were sampled counts as between_forwards."""
        if self._model_done is not None:
            self.seconds["between_forwards"] += time.perf_counter() - self._model_done

    def model_done(self) -> None:
        self._model_done = time.perf_counter()

    def idle(self) -> None:
        """A step with nothing to run: the wait for the next request is not host time between forwards."""
        self._model_done = None

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0
        self._model_done = None

    def table(self) -> str:
        total = sum(v for k, v in self.seconds.items() if k not in self.NESTED) or 1.0
        lines = [f"{'phase':<22}{'total s':>10}{'share':>8}{'ms/step':>10}"]
        extra = sorted(set(self.seconds) - set(self.PHASES))   # nested ones (communication, drafting) last
        for name in (*self.PHASES, *extra):
            s = self.seconds.get(name, 0.0)
            lines.append(f"{name:<22}{s:>10.2f}{100 * s / total:>7.1f}%{1000 * s / max(self.steps, 1):>10.2f}")
        lines.append(f"{'steps':<22}{self.steps:>10}")
        return "\n".join(lines)
