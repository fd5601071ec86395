"""One rank of a tensor- or pipeline-parallel engine: its share of the CPUs, its process groups, its model
shard and KV cache, and the step protocol every rank follows.

Each step, rank 0 (in the engine-core process) broadcasts the scheduler output to all ranks over
torch.distributed; every rank runs its part; the rank that sampled (the last stage's first tensor-parallel
rank) broadcasts the sampled tokens back, which keeps every rank's copy of the requests' tokens the same and
hands the result to rank 0."""

from __future__ import annotations

import os

import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.comm import take_collective_seconds
from tokenmill.distributed.parallel_state import destroy_distributed, init_distributed, output_rank
from tokenmill.platform import bind_cpu_threads, device_type, keep_freed_memory, select_cpu_kernels
from tokenmill.utils import init_logger

logger = init_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, init_method: str, cpus: list[int] | None):
        from tokenmill.worker.model_runner import ModelRunner

        p = config.parallel_config
        self.rank, self.world_size = rank, p.world_size
        self.output_rank = output_rank(p.tensor_parallel_size, p.pipeline_parallel_size)
        device = device_type()
        if device == "cpu":
            if cpus is not None and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cpus)   # a spawned rank starts with its parent's (pinned) thread's set
            logger.info("rank %d CPU kernels: %s", rank, select_cpu_kernels(config.cpu_isa))
            logger.info("rank %d intra-op threads: %s", rank, bind_cpu_threads(config.cpu_bind, cpus))
            keep_freed_memory()
        if device == "cuda":
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())   # a Ray actor sees only its own GPU
        init_distributed(rank, p.tensor_parallel_size, p.pipeline_parallel_size, init_method,
                         "nccl" if device == "cuda" else "gloo", p.enable_expert_parallel)
        self.runner = ModelRunner(config, device)
        self.runner.load_model()
        self.runner.initialize_kv_cache()
        self.profile = self.runner.profile
        logger.info("rank %d: %s", rank, self._layout(config))

    def _layout(self, config: EngineConfig) -> str:
        """Which layers, heads and experts this rank holds, for the start-up log."""
        from tokenmill.model.moe import FusedExperts

        model = self.runner.model
        stage = model.model.stage
        attn = model.model.layers[stage.start].self_attn
        text = (f"layers {stage.start}-{stage.stop - 1}, {attn.num_heads} query / {attn.num_kv_heads} KV heads, "
                f"{config.cache_config.num_blocks} KV blocks")
        experts = next((m for m in model.modules() if isinstance(m, FusedExperts)), None)
        if experts is not None:
            first = experts.first_expert
            text += (f", experts {first}-{first + experts.num_local - 1}" if experts.expert_parallel
                     else f", every expert's intermediate slice of {experts.inter}")
        return text

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute_model(so)
        self.profile.seconds["all_reduce"] += take_collective_seconds()   # (part of forward's time)
        if self.world_size > 1:
            with self.profile.phase("broadcast_output"):
                box = [out]
                dist.broadcast_object_list(box, src=self.output_rank)
            if self.rank != self.output_rank:
                out = box[0]
                self.runner.apply_output(out)
        return out

    def broadcast_step(self, so: SchedulerOutput | None) -> SchedulerOutput | None:
        """Rank 0 sends the step (None: shut down); the other ranks receive it."""
        with self.profile.phase("broadcast_step"):
            box = [so]
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def run_loop(self) -> None:
        """A rank past the first: follow rank 0's steps until it says stop (or a peer dies, which raises)."""
        try:
            while (so := self.broadcast_step(None)) is not None:
                self.execute_model(so)
        finally:
            destroy_distributed()
