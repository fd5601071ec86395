"""The flat varlen batch of one forward pass, built with vectorized numpy: shared by the model runner and
the draft model, which runs its own passes over the same block tables."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata, host_arrays_to
from tokenmill.worker.input_batch import CachedRequestState


def varlen_batch(states: list[CachedRequestState], start: np.ndarray, n: np.ndarray, block_size: int,
                 token_offset: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Request i runs positions start[i] : start[i] + n[i], with start[i] + n[i] tokens of context, on the tokens
    its buffer holds there (or `token_offset` further on: an EAGLE head reads the next token at each position).
    Returns input ids, positions and the attention metadata, on `device` (built on the host, copied once)."""
    qsl = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    req_idx = np.repeat(np.arange(len(states)), n)
    positions = start[req_idx] + np.arange(int(qsl[-1])) - qsl[req_idx]
    first = start + token_offset
    input_ids = np.concatenate([s.token_buf[b: b + k] for s, b, k in zip(states, first, n)])
    max_blocks = max(len(s.block_ids) for s in states)
    block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
    for i, s in enumerate(states):
        block_table[i, : len(s.block_ids)] = s.block_ids
    slot_mapping = block_table[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = start + n
    arrays = (input_ids, positions, slot_mapping, block_table, qsl, seq_lens)
    tensors = [torch.from_numpy(a) for a in arrays] if device == "cpu" else host_arrays_to(device, *arrays)
    ids, pos, slots, table, qsl_t, lens = tensors
    md = AttentionMetadata(slot_mapping=slots, block_table=table, query_start_loc=qsl_t, seq_lens=lens,
                           query_start_loc_np=qsl, seq_lens_np=seq_lens, max_query_len=int(n.max()),
                           max_seq_len=int(seq_lens.max()))
    return ids, pos, md
