"""Embedding and cross-encoder requests in the runner: a prompt's final hidden states pooled as its chunks arrive."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.worker.input_batch import CachedRequestState


def pool_outputs(model, requests: dict[str, CachedRequestState], req_ids: list[str], md: AttentionMetadata,
                 hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
    """Embedding requests: their prompt's final hidden states pooled over the chunks it arrives in (the sum for
    mean, the first position for cls), and at the prompt's last chunk the embedding (last: its final row)."""
    qsl, seq_lens = md.query_start_loc_np, md.seq_lens_np
    head = getattr(model, "pooled_output", None)
    for r, rid in enumerate(req_ids):
        state = requests[rid]
        kind = state.sampling_params.pooling
        if kind is None:
            continue
        rows = hidden[int(qsl[r]):int(qsl[r + 1])].float()
        if kind == "mean":
            part = rows.sum(0)
            state.pool_acc = part if state.pool_acc is None else state.pool_acc + part
        elif kind == "cls" and int(seq_lens[r]) == len(rows):   # the chunk that starts the prompt
            state.pool_acc = rows[0].clone()
        if int(seq_lens[r]) < state.num_prompt_tokens:
            continue
        if kind == "last":
            vec = rows[-1]
        else:
            vec = state.pool_acc / state.num_prompt_tokens if kind == "mean" else state.pool_acc
        if head is not None:   # a cross-encoder: its label logits
            vec = head(vec)
        if state.sampling_params.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        result.pooled[rid] = vec.tolist()
