"""`tokenmill router --replicas N --distributed-executor-backend ray`: the replicas are `tokenmill serve` processes
that Ray places on a running cluster's nodes (spread over them), one actor each; the actor starts the server on
its node (listening on the node's address, each pinned to its share of that node's cores when several share
it) and stops it (SIGTERM: drain) when the router exits."""

from __future__ import annotations

import os
import subprocess
import sys

from tokenmill.utils import init_logger

logger = init_logger(__name__)


class ReplicaActor:
    """One replica: a `tokenmill serve` subprocess on the node Ray chose (wrapped with ray.remote at start)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, port: int, argv: list[str], index: int, count: int) -> str:
        """Replica `index` of the `count` placed on this node gets that share of the node's cores."""
        from tokenmill.platform import one_cpu_per_core, process_cpus, rank_cpus

        host = self.node_ip()
        if not any(a.split("=")[0] == "--cpu-bind" for a in argv):
            share = rank_cpus(one_cpu_per_core(process_cpus()), index, count)
            argv = [*argv, "--cpu-bind", ",".join(map(str, share))]
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--host", host, "--port", str(port), *argv]
        self.proc = subprocess.Popen(cmd, env=os.environ.copy())
        return f"http://{host}:{port}"

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode


class RayReplicas:
    """N replica actors spread over the cluster; `urls` are where their servers listen."""

    def __init__(self, n: int, port_base: int, argv: list[str], cpus_per_replica: float = 1.0):
        from tokenmill.executor.ray_executor import connect_ray

        ray = connect_ray()
        actor = ray.remote(num_cpus=cpus_per_replica, scheduling_strategy="SPREAD")(ReplicaActor)
        self.actors = [actor.remote() for _ in range(n)]
        nodes = ray.get([a.node_ip.remote() for a in self.actors])
        index = [nodes[:i].count(ip) for i, ip in enumerate(nodes)]   # its place among the replicas on its node
        self.urls = ray.get([a.start.remote(port_base + i, argv, index[i], nodes.count(nodes[i]))
                             for i, a in enumerate(self.actors)])
        for i, url in enumerate(self.urls):
            logger.info("replica %d started by Ray at %s", i, url)

    def stop(self) -> None:
        import ray

        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        except Exception as e:  # noqa: BLE001 - a node gone with its replica: nothing left to stop there
            logger.warning("stopping the Ray replicas: %s", e)
        for a in self.actors:
            ray.kill(a)


class RayLauncher:
    """The autoscaler's launcher on Ray: one actor per replica, started and stopped one at a time (each takes its
    node's cores unless given --cpu-bind in the replica args; SPREAD places them on different nodes first)."""

    def __init__(self, max_replicas: int, port_base: int, argv: list[str], cpus_per_replica: float = 1.0):
        from tokenmill.executor.ray_executor import connect_ray

        self.ray = connect_ray()
        self.actor_class = self.ray.remote(num_cpus=cpus_per_replica, scheduling_strategy="SPREAD")(ReplicaActor)
        self.max_replicas, self.port_base, self.argv = max_replicas, port_base, argv
        self.actors: dict[str, tuple[int, object]] = {}   # url -> (slot, actor)

    def start(self) -> str:
        used = {slot for slot, _ in self.actors.values()}
        slot = next(s for s in range(self.max_replicas) if s not in used)
        actor = self.actor_class.remote()
        url = self.ray.get(actor.start.remote(self.port_base + slot, self.argv, 0, 1))
        self.actors[url] = (slot, actor)
        logger.info("replica %d started by Ray at %s", slot, url)
        return url

    def stop(self, url: str) -> None:
        _, actor = self.actors.pop(url, (None, None))
        if actor is None:
            return
        try:
            self.ray.get(actor.stop.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - its node is gone with it: nothing left to stop
            logger.warning("stopping the Ray replica %s: %s", url, e)
        self.ray.kill(actor)

    def alive(self, url: str) -> bool:
        return url in self.actors

    def stop_all(self) -> None:
        for url in list(self.actors):
            self.stop(url)
