"""The runner's encoder stage (vision models): runs the vision tower on the items the scheduler names, keeps
their embeddings by content hash, and writes them into the placeholder rows of a step's input embeddings, so a
prompt chunk that ends inside an image takes the rows it reaches and the next chunk the rest."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.worker.input_batch import CachedRequestState


class EncoderRunner:
    def __init__(self, model, device: str):
        self.model, self.device = model, device
        self.cache: dict[str, torch.Tensor] = {}   # identifier -> embeddings [tokens, hidden]

    def run(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        for identifier in so.free_encoder_ids:
            self.cache.pop(identifier, None)
        todo: dict[str, MultiModalFeature] = {}
        for rid, indices in so.scheduled_encoder_inputs.items():
            features = requests[rid].mm_features
            for i in indices:
                f = features[i]
                if f.identifier not in self.cache:
                    todo[f.identifier] = f
        by_shape: dict[tuple, list[MultiModalFeature]] = {}
        for f in todo.values():   # items of one shape go through the tower as one batch
            by_shape.setdefault(tuple((k, tuple(v.shape)) for k, v in sorted(f.data.items())), []).append(f)
        for group in by_shape.values():
            inputs = [{k: torch.from_numpy(v.numpy().copy()).to(self.device) for k, v in f.data.items()}
                      for f in group]
            for f, emb in zip(group, self.model.embed_multimodal(inputs)):
                if emb.shape[0] != f.length:
                    raise RuntimeError(f"the encoder made {emb.shape[0]} embeddings for an item of {f.length} "
                                       "placeholders")
                self.cache[f.identifier] = emb

    def has_work(self, so: SchedulerOutput) -> bool:
        return bool(so.scheduled_encoder_inputs or so.free_encoder_ids)

    def prepare_step(self, inp, states: list[CachedRequestState], start: np.ndarray, n: np.ndarray,
                     query_start: np.ndarray) -> None:
        """The step's input embeddings where it reaches placeholders, and M-RoPE's rows (Qwen2-VL)."""
        inp.inputs_embeds = self.inputs_embeds(inp.input_ids, states, start, n, query_start)
        mrope = getattr(self.model, "mrope", None)
        if mrope is not None:
            mrope.remap(inp.positions, states, start, n, query_start, self.model.spatial_merge_size)

    def inputs_embeds(self, input_ids: torch.Tensor, states: list[CachedRequestState], start: np.ndarray,
                      n: np.ndarray, query_start: np.ndarray) -> torch.Tensor | None:
        """The step's input embeddings with each reached placeholder row replaced by its image's embedding;
        None when no scheduled token is a placeholder (the model embeds the ids itself)."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for r, state in enumerate(states):
            if not state.mm_features:
                continue
            first, end = int(start[r]), int(start[r] + n[r])
            for f in state.mm_features:
                lo, hi = max(first, f.offset), min(end, f.end)
                if lo >= hi:
                    continue
                base = int(query_start[r]) - first
                rows.append(torch.arange(base + lo, base + hi))
                values.append(self.cache[f.identifier][lo - f.offset: hi - f.offset])
        if not rows:
            return None
        x = self.model.embed_input_ids(input_ids)
        x[torch.cat(rows).to(x.device)] = torch.cat(values).to(x.dtype)
        return x
