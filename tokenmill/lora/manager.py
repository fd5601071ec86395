"""The worker's adapter manager: loads PEFT folders (keeping up to max_cpu_loras), gives the adapters of each
step a slot (max_loras of them; the scheduler never runs more at once), and sets the step's token -> slot mask
that the adapted layers read."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from tokenmill.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.layers import LoRALinearWeights, LoRAStep
from tokenmill.lora.request import LoRARequest
from tokenmill.utils import init_logger

logger = init_logger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: str = "cpu"):
        self.config = config
        self.hf_config = model.config
        self.step = LoRAStep(dtype, device)
        self.layers: dict[tuple[int, str], LoRALinearWeights] = {}   # (layer index, fused layer name)
        fused = sorted({name for name, _ in TARGETS.values()})
        for index in model.model.stage:
            decoder = model.model.layers[index]
            for name in fused:
                linear = _submodule(decoder, name)
                if linear is None or not hasattr(linear, "lora"):
                    continue   # (a mixture-of-experts MLP has no dense gate/up/down)
                sizes = list(getattr(linear, "out_sizes", None) or [linear.out_features])
                linear.lora = LoRALinearWeights(linear.in_features, sizes, config.max_loras, config.max_lora_rank,
                                                self.step, dtype, device)
                self.layers[(index, name)] = linear.lora
        self.slots: list[int | None] = [None] * config.max_loras     # lora_int_id held by each slot
        self.slot_used: list[int] = [0] * config.max_loras             # step count of last use (LRU)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()     # by lora_int_id, least recent first
        self.steps = 0
        nbytes = sum(t.numel() * t.element_size() for w in self.layers.values()
                     for t in (w.a, w.b_t, w.a32, w.b32) if t is not None)
        logger.info("LoRA: %d adapter slots of rank %d over %d layers (%.1f MiB), up to %d adapters loaded",
                    config.max_loras, config.max_lora_rank, len(self.layers), nbytes / 2**20, config.max_cpu_loras)

    # ---- per step -----------------------------------------------------------------------------
    def set_step(self, loras: list[LoRARequest | None], num_tokens: np.ndarray) -> None:
        """Rows' adapters (None: the base model) and their scheduled token counts, in the step's order."""
        if all(lora is None for lora in loras):
            return
        self.steps += 1
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        slot_of = {lora_id: self._slot_for(lora, needed) for lora_id, lora in needed.items()}
        row_slot = np.array([slot_of[lora.lora_int_id] if lora is not None else -1 for lora in loras])
        self.step.begin(np.repeat(row_slot, num_tokens))

    def end_step(self) -> None:
        self.step.end()

    def _slot_for(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        if lora.lora_int_id in self.slots:
            slot = self.slots.index(lora.lora_int_id)
        else:   # the lowest free slot (few slots in play keep the matmuls narrow), else the least recent
            free = [i for i, held in enumerate(self.slots) if held is None]
            evictable = free or [i for i, held in enumerate(self.slots) if held not in needed]
            if not evictable:
                raise RuntimeError(f"a step needs more than max_loras ({self.config.max_loras}) adapters")
            slot = min(evictable) if free else min(evictable, key=lambda i: self.slot_used[i])
            self._fill(slot, self._adapter(lora))
            self.slots[slot] = lora.lora_int_id
        self.slot_used[slot] = self.steps
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        per_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (index, module), (a, b) in adapter.weights.items():
            name, shard = TARGETS[module]
            per_layer.setdefault((index, name), {})[shard or 0] = (a, b)
        for key, weights in self.layers.items():
            shards = per_layer.get(key)
            if shards:
                weights.set_slot(slot, shards)
            else:
                weights.clear_slot(slot)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.loaded.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
            self.loaded[lora.lora_int_id] = adapter
            logger.info("LoRA adapter %s (id %d) loaded from %s: rank %d, %s", lora.lora_name, lora.lora_int_id,
                        lora.lora_path, adapter.spec.rank, ", ".join(adapter.spec.modules))
            while len(self.loaded) > self.config.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(lora.lora_int_id)
        return adapter


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
