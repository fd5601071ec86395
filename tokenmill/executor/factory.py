"""Picks the executor for a config's parallel backend; each executor module imports only the base class, so the
choice lives here, on the side that owns them, and no executor module imports another's chooser."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; rank processes (`mp`) or Ray actors (`ray`) for tensor or pipeline parallel."""
    backend = config.parallel_config.backend
    if backend == "uni":
        from tokenmill.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
