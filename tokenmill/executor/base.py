"""The executor runs the model for the engine core: in-process for one device, rank processes for TP > 1."""

from __future__ import annotations

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor:
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
