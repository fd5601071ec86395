"""The flat varlen batch of one forward pass, built with vectorized numpy: shared by the model runner and
the draft model, which runs its own passes over the same block tables."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
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
    md = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping), block_table=torch.from_numpy(block_table),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        query_start_loc_np=qsl, seq_lens_np=seq_lens, max_query_len=int(n.max()), max_seq_len=int(seq_lens.max()))
    if device != "cpu":
        return _on_device(input_ids, positions, md, device)
    return torch.from_numpy(input_ids), torch.from_numpy(positions), md


def _on_device(input_ids: np.ndarray, positions: np.ndarray, md: AttentionMetadata,
               device: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's arrays in one host-to-device copy (each copy from pageable memory waits for the device to
    finish what is queued before it), viewed back as the tensors (the block table as int64 there)."""
    arrays = [input_ids, positions, md.slot_mapping.numpy(), md.block_table.numpy(), md.query_start_loc_np,
              md.seq_lens_np]
    flat = torch.from_numpy(np.concatenate([a.ravel().astype(np.int64, copy=False) for a in arrays])).to(device)
    views, offset = [], 0
    for a in arrays:
        views.append(flat[offset:offset + a.size].view(a.shape))
        offset += a.size
    ids, pos, slots, table, qsl, seq_lens = views
    md = replace(md, slot_mapping=slots, block_table=table, query_start_loc=qsl, seq_lens=seq_lens)
    return ids, pos, md
