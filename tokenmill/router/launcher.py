"""Starting and stopping one replica at a time, for the autoscaler: local `tokenmill serve` processes, each in a
slot of the fleet's largest size (a port and a share of the CPUs of its own), or Ray actors on a cluster's nodes.
`start` returns as soon as the replica is launched (it joins the rotation when its health check passes); `stop`
sends SIGTERM, which makes a replica drain its in-flight requests and exit, and blocks until it has."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Protocol

from tokenmill.utils import init_logger

logger = init_logger(__name__)


class ReplicaLauncher(Protocol):
    def start(self) -> str: ...          # the new replica's base URL
    def stop(self, url: str) -> None: ...
    def alive(self, url: str) -> bool: ...
    def stop_all(self) -> None: ...


def terminate(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM (the replica drains, then exits), then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ProcessLauncher:
    """Replicas on this machine. Slot i of `max_replicas` listens on port_base + i and is pinned to the i-th share
    of the CPUs, so replicas started and stopped over time never share a core or a port."""

    def __init__(self, max_replicas: int, port_base: int, extra_args: str = ""):
        from tokenmill.platform import one_cpu_per_core, process_cpus

        self.max_replicas, self.port_base = max_replicas, port_base
        self.argv = shlex.split(extra_args)
        self.cpus = one_cpu_per_core(process_cpus())
        self.procs: dict[int, subprocess.Popen] = {}   # slot -> process

    def _url(self, slot: int) -> str:
        return f"http://127.0.0.1:{self.port_base + slot}"

    def _slot(self, url: str) -> int:
        return int(url.rsplit(":", 1)[1]) - self.port_base

    def start(self) -> str:
        from tokenmill.platform import rank_cpus

        free = [s for s in range(self.max_replicas) if s not in self.procs]
        if not free:
            raise RuntimeError(f"all {self.max_replicas} replica slots are in use")
        slot = free[0]
        share = rank_cpus(self.cpus, slot, self.max_replicas)
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--host", "127.0.0.1",
               "--port", str(self.port_base + slot), "--cpu-bind", ",".join(map(str, share)), *self.argv]
        logger.info("starting replica %d on port %d, CPUs %s", slot, self.port_base + slot, share)
        self.procs[slot] = subprocess.Popen(cmd, env=os.environ.copy())
        return self._url(slot)

    def stop(self, url: str) -> None:
        proc = self.procs.get(self._slot(url))
        if proc is not None:
            terminate(proc)
            logger.info("replica %s stopped (exit %s)", url, proc.returncode)
            self.procs.pop(self._slot(url), None)

    def alive(self, url: str) -> bool:
        proc = self.procs.get(self._slot(url))
        return proc is not None and proc.poll() is None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            terminate(p)
        self.procs.clear()
