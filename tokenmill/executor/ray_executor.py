"""Tensor or pipeline parallel over a Ray cluster: rank 0 runs in the engine-core process, ranks 1..N-1 are Ray
actors that Ray places on the cluster's nodes. The ranks then talk over torch.distributed exactly as with the
`mp` executor (Ray only starts and places them): start a cluster first (`ray start --head` on one machine,
`ray start --address HEAD:6379` on the others), then `tokenmill serve --distributed-executor-backend ray`."""

from __future__ import annotations

import os

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.executor.multiproc import free_port
from tokenmill.platform import device_type, engine_cpus, rank_cpus
from tokenmill.utils import init_logger

logger = init_logger(__name__)


class RankActor:
    """One rank in a Ray worker process (wrapped with ray.remote when the executor starts)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, config: EngineConfig, rank: int, init_method: str, cpus: list[int] | None) -> int:
        from tokenmill.worker.worker import Worker

        self.worker = Worker(config, rank, init_method, cpus)
        return os.getpid()

    def run_loop(self) -> None:
        self.worker.run_loop()


def connect_ray():
    """The running cluster (RAY_ADDRESS, else the local one); a clear error naming the flag if there is none."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend ray: Ray is not installed (pip install 'ray>=2.9')") from None
    if not ray.is_initialized():
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True,
                     logging_level="warning")
        except (ConnectionError, RuntimeError) as e:
            raise ValueError("distributed_executor_backend ray: no Ray cluster is reachable (start one with "
                             f"`ray start --head`, or set RAY_ADDRESS): {e}") from None
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from tokenmill.worker.worker import Worker

        ray = connect_ray()
        p = config.parallel_config
        self.world_size = p.world_size
        cuda = device_type() == "cuda"
        remote_cls = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0)(RankActor)
        self.actors = [remote_cls.remote() for _ in range(1, self.world_size)]
        driver_ip = ray.util.get_node_ip_address()
        ips = ray.get([a.node_ip.remote() for a in self.actors])
        init_method = f"tcp://{driver_ip}:{free_port()}"
        # ranks that share this machine share its CPUs as the mp executor's do; a rank elsewhere has its node's
        cpus = engine_cpus(config.cpu_bind) if not cuda else None
        local = [0] + [r for r, ip in enumerate(ips, start=1) if ip == driver_ip]
        share = {r: rank_cpus(cpus, i, len(local)) for i, r in enumerate(local)} if cpus else {}
        started = [a.start.remote(config, r, init_method, share.get(r)) for r, a in enumerate(self.actors, start=1)]
        self.worker = Worker(config, 0, init_method, share.get(0))
        pids = ray.get(started)
        self.loops = [a.run_loop.remote() for a in self.actors]
        self.profile = self.worker.profile
        logger.info("%d ranks ready over Ray: rank 0 here (%s), ranks 1-%d on %s (pids %s)", self.world_size,
                    driver_ip, self.world_size - 1, ", ".join(ips), ", ".join(map(str, pids)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.worker.broadcast_step(scheduler_output)
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        import ray

        worker = getattr(self, "worker", None)
        if worker is None:
            return
        self.worker = None
        try:
            worker.broadcast_step(None)
            ray.get(self.loops, timeout=30)
        except Exception:   # noqa: BLE001 - a rank already died; its actor is killed below
            pass
        from tokenmill.distributed.parallel_state import destroy_distributed

        destroy_distributed()
        for actor in self.actors:
            ray.kill(actor)
