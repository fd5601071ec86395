"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """The flat varlen batch: request i owns query tokens query_start_loc[i]:query_start_loc[i+1] and has
    seq_lens[i] tokens of context (cached + new), whose K/V live in the blocks of block_table[i]."""

    slot_mapping: torch.Tensor      # [T] int64: block_id * block_size + offset for each new token
    block_table: torch.Tensor       # [B, max_blocks] int32/int64
    query_start_loc: torch.Tensor   # [B + 1]
    seq_lens: torch.Tensor          # [B]
    # Host copies, so backends that loop or choose kernels do not read the device.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    max_query_len: int
    max_seq_len: int
    # What a backend derives once per step and every layer reuses (keyed by backend name).
    backend_plan: dict = field(default_factory=dict)
    # The tokens whose final hidden states the step uses (int64, ascending), or None for all. A model may then
    # return only these rows (the native decoder stack's last layer runs its o-proj and MLP for them alone).
    output_rows: torch.Tensor | None = None
    # An encoder-decoder model (Whisper): each request's slot in the cross-attention cache group.
    cross_slots: list[int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_np)

    def to(self, device: str | torch.device) -> AttentionMetadata:
        """The same step, built on the host, with its tensors on `device` (int64 there; the host copies stay)."""
        slots, table, qsl, lens = host_arrays_to(device, *(t.numpy() for t in (
            self.slot_mapping, self.block_table, self.query_start_loc, self.seq_lens)))
        rows = None if self.output_rows is None else self.output_rows.to(device)
        return replace(self, slot_mapping=slots, block_table=table, query_start_loc=qsl, seq_lens=lens,
                       output_rows=rows, backend_plan={})


def host_arrays_to(device: str | torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Integer host arrays as int64 tensors on `device`, in one copy viewed back in their shapes: on a GPU each
    copy from pageable memory waits for every kernel queued before it."""
    flat = torch.from_numpy(np.concatenate([a.ravel().astype(np.int64, copy=False) for a in arrays])).to(device)
    out, offset = [], 0
    for a in arrays:
        out.append(flat[offset:offset + a.size].view(a.shape))
        offset += a.size
    return out


class AttentionBackend:
    """Computes attention for the flat batch, reading K/V (already written for the new tokens) from the cache."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: the new tokens' [T, Hkv, D], already in kv_cache [2, N, block_size, Hkv, D]
        (quantized there, when its dtype is, with k_scale and v_scale: see attention/ops.py). window > 0: a
        sliding-window layer, where the token at position p sees keys p - window + 1 .. p only (transformers'
        mask). Returns [T, Hq, D]."""
        raise NotImplementedError
