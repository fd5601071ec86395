"""The runner's encoder stage for an encoder-decoder model (Whisper): runs the audio encoder on the requests the
scheduler starts this step, in one batch, and writes each decoder layer's cross-attention K/V of its output into
a slot the request keeps until it finishes or is preempted; each step's metadata names every request's slot."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.worker.input_batch import CachedRequestState


class CrossAttentionRunner:
    def __init__(self, model, device: str, num_slots: int):
        self.model, self.device = model, device
        self.free = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}

    def allocate(self, dtype: torch.dtype) -> int:
        """Every cross-attention layer's cache of all slots; returns its bytes."""
        total = 0
        slots = len(self.free)
        for layer in self.model.cross_attention_layers():
            positions = self.model.config.max_source_positions
            layer.cache = torch.empty(2, slots, layer.heads, positions, layer.head_dim, dtype=dtype,
                                      device=self.device)
            total += layer.cache.numel() * layer.cache.element_size()
        return total

    def has_work(self, so: SchedulerOutput) -> bool:
        return bool(so.scheduled_encoder_inputs or self.slot_of and (so.finished_req_ids or so.preempted_req_ids))

    def run(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free.append(slot)
        rids = list(so.scheduled_encoder_inputs)
        if not rids:
            return
        slots = [self.free.pop() for _ in rids]
        self.slot_of.update(zip(rids, slots))
        features = np.stack([requests[r].mm_features[0].data["input_features"].numpy() for r in rids])
        self.model.encode(torch.from_numpy(features).to(self.device), slots)

    def prepare_step(self, inp, states: list[CachedRequestState], start: np.ndarray, n: np.ndarray,
                     query_start: np.ndarray) -> None:
        inp.attn_metadata.cross_slots = [self.slot_of[s.req_id] for s in states]
