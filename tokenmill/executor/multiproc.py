"""Tensor or pipeline parallel on one machine: rank 0 runs in the engine-core process, ranks 1..N-1 in worker
processes started with spawn. Steps and sampled tokens travel over torch.distributed (see worker/worker.py);
the pipes here only carry start-up news, so that a rank that fails to start is an error, not a hang."""

from __future__ import annotations

import multiprocessing
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.platform import device_type, engine_cpus, rank_cpus
from tokenmill.utils import init_logger

logger = init_logger(__name__)

START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(config: EngineConfig, rank: int, init_method: str, cpus: list[int] | None, conn: Connection) -> None:
    from tokenmill.worker.worker import Worker

    try:
        conn.send(("joining", None))
        worker = Worker(config, rank, init_method, cpus)
        conn.send(("ready", None))
    except BaseException:   # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))
        raise
    worker.run_loop()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from tokenmill.worker.worker import Worker

        p = config.parallel_config
        self.world_size = p.world_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        cpus = engine_cpus(config.cpu_bind) if device_type() == "cpu" else None
        shares = [rank_cpus(cpus, r, self.world_size) if cpus else None for r in range(self.world_size)]
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(config, rank, init_method, shares[rank], child),
                               name=f"tokenmill-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._wait_for("joining")
        self.worker = Worker(config, 0, init_method, shares[0])
        self._wait_for("ready")
        self.profile = self.worker.profile
        logger.info("%d ranks ready (rank 0 in this process, %d worker processes)", self.world_size, len(self.procs))

    def _wait_for(self, state: str) -> None:
        """Every worker's next start-up message, or a clear error if one fails or dies first."""
        pending = dict(zip(self.conns, self.procs))
        while pending:
            ready = wait(list(pending) + [p.sentinel for p in pending.values()], timeout=START_TIMEOUT_S)
            if not ready:
                self.shutdown()
                raise RuntimeError(f"worker ranks did not report '{state}' within {START_TIMEOUT_S:.0f} s")
            for conn in [c for c in ready if isinstance(c, Connection)]:
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    kind, detail = "error", "it exited"
                if kind == "error":
                    proc = pending[conn]
                    self.shutdown()
                    raise RuntimeError(f"{proc.name} failed to start:\n{detail}")
                del pending[conn]
            for conn, proc in list(pending.items()):
                if not proc.is_alive() and not conn.poll():
                    self.shutdown()
                    raise RuntimeError(f"{proc.name} exited during start-up (code {proc.exitcode})")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            self.worker.broadcast_step(scheduler_output)
            return self.worker.execute_model(scheduler_output)
        except RuntimeError as e:   # a collective failed: name the rank that died, if one did
            time.sleep(0.2)
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"worker rank died: {', '.join(dead)}") from e
            raise

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            self.worker = None
            try:
                if all(p.is_alive() for p in self.procs):
                    worker.broadcast_step(None)
            except RuntimeError:
                pass   # a rank already died: the others exit when their next collective fails
            from tokenmill.distributed.parallel_state import destroy_distributed

            destroy_distributed()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs = []
