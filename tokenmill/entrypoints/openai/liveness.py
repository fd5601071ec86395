"""The engine watchdog: a server whose engine stops making progress goes red on /health, and exits non-zero
after a second, longer timeout so a supervisor restarts it (in-flight requests are answered with an error)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

from tokenmill.utils import init_logger

logger = init_logger(__name__)


@dataclass
class Liveness:
    stall_timeout: float = 30.0        # /health and /ready red after this long without a step while work waits
    stall_exit_timeout: float = 120.0  # then kill the engine and exit non-zero (0: never)

    async def watch(self, engine, period: float = 0.5) -> None:
        warned = False
        while True:
            await asyncio.sleep(period)
            if engine.dead or engine.client is None:
                continue
            stalled = engine.stalled_for()
            if self.stall_timeout and stalled > self.stall_timeout and not warned:
                logger.error("the engine has made no progress for %.0f s with %d requests pending", stalled,
                             engine.num_unfinished)
            warned = bool(self.stall_timeout) and stalled > self.stall_timeout
            if self.stall_exit_timeout and stalled > self.stall_exit_timeout:
                logger.error("the engine is stuck (%.0f s without progress): killing it so the server exits and a "
                             "supervisor can restart it", stalled)
                os.kill(engine.client.proc.pid, signal.SIGKILL)
                return
