"""Tensor-parallel size 1: the model runner lives in the engine-core process."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.platform import bind_cpu_threads, device_type, keep_freed_memory, select_cpu_kernels
from tokenmill.utils import init_logger

logger = init_logger(__name__)


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from tokenmill.worker.model_runner import ModelRunner

        if device_type() == "cpu":
            logger.info("CPU kernels: %s", select_cpu_kernels(config.cpu_isa))
            logger.info("intra-op threads: %s", bind_cpu_threads(config.cpu_bind))
            if not keep_freed_memory():
                logger.info("not glibc: freed activation memory may be returned to the kernel each step")
        self.runner = ModelRunner(config, device_type())
        self.runner.load_model()
        self.runner.initialize_kv_cache()
        self.profile = self.runner.profile

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def prefault_kv(self, first_block: int, end_block: int) -> bool:
        return self.runner.prefault_kv(first_block, end_block)
