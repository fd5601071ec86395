"""The engine's LoRA limits (vLLM's flags: --max-loras, --max-lora-rank, --max-cpu-loras)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1          # adapters one step may run (slots in the stacked weights)
    max_lora_rank: int = 16     # every slot is this wide; a larger adapter is refused
    max_cpu_loras: int = 1      # adapters kept loaded, slotted or not (at least max_loras)

    @classmethod
    def create(cls, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> LoRAConfig:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {max_lora_rank}")
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if cpu < max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be at least max_loras ({max_loras})")
        return cls(max_loras, max_lora_rank, cpu)
