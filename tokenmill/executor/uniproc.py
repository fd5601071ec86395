"""Tensor-parallel size 1: the model runner lives in the engine-core process."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.platform import device_type, num_physical_cores


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        import torch

        from tokenmill.worker.model_runner import ModelRunner

        if device_type() == "cpu":
            torch.set_num_threads(num_physical_cores())
        self.runner = ModelRunner(config, device_type())
        self.runner.load_model()
        self.runner.initialize_kv_cache()
        self.profile = self.runner.profile

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
