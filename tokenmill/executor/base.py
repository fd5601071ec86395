"""The executor runs the model for the engine core: in-process for one device, rank processes for TP > 1."""

from __future__ import annotations

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor:
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def prefault_kv(self, first_block: int, end_block: int) -> bool:
        """Write the KV cache's blocks [first_block, end_block) once, so that their first use pays no page
        faults; False where the executor has nothing to do this way (caches zeroed at allocation, other ranks)."""
        return False

    def shutdown(self) -> None:
        pass
