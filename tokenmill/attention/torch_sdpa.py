"""A torch-only backend: the fallback where the native CPU kernel cannot be built, and the prompt path of it.

Decode rows (one new token) go through one batched gather + grouped-query matmul with no per-request
loop (SDPA is pathological for q_len=1 on CPU); prompt rows use SDPA, causal on the fresh K/V when no
prefix is cached, with an explicit mask over the gathered cache when one is.

What the decode rows' index tensors and mask are is the same in every layer: they are made once a step (the
step's plan). On a GPU that is also one host-to-device copy a step instead of three a layer, each of which
made the host wait for every kernel queued before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import dequantize_kv


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int = 0) -> torch.Tensor:
        out = torch.empty_like(q)
        q_lens = np.diff(md.query_start_loc_np)
        decode_rows = np.nonzero(q_lens == 1)[0]
        scales = (k_scale, v_scale)
        if len(decode_rows):
            self._decode(q, kv_cache, md, scale, decode_rows, out, scales, window)
        for i in np.nonzero(q_lens > 1)[0].tolist():
            sdpa_prompt_row(q, k, v, kv_cache, md, scale, i, out, scales, window)
        return out

    @staticmethod
    def _decode(q, kv_cache, md, scale, rows: np.ndarray, out: torch.Tensor, scales=(1.0, 1.0),
                window: int = 0) -> None:
        _, _, block_size, hkv, d = kv_cache.shape
        plan = md.backend_plan.get("torch_sdpa")
        if plan is None or plan.block_size != block_size:
            plan = md.backend_plan["torch_sdpa"] = DecodePlan.make(md, rows, block_size, q.device)
        n = len(rows)
        keys, vals = (dequantize_kv(kv_cache[i].index_select(0, plan.blocks), scales[i], q.dtype)
                      .view(n, plan.max_blocks * block_size, hkv, d).transpose(1, 2) for i in (0, 1))
        qg = q.index_select(0, plan.token_idx).view(n, hkv, -1, d)           # [n, Hkv, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [n, Hkv, G, S]
        invalid = plan.invalid
        if window:
            invalid = invalid | (plan.pos[None, :] < plan.lens - window)
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vals.dtype)
        out.index_copy_(0, plan.token_idx, torch.matmul(probs, vals).reshape(n, -1, d))


@dataclass
class DecodePlan:
    """The decode rows' tensors every layer of a step reads: their query tokens, cache blocks (max_blocks a row,
    row after row) and the mask of the key positions past each row's length."""

    block_size: int
    max_blocks: int
    token_idx: torch.Tensor   # [n]
    blocks: torch.Tensor      # [n * max_blocks] int64
    pos: torch.Tensor         # [max_blocks * block_size]
    lens: torch.Tensor        # [n, 1]
    invalid: torch.Tensor     # [n, max_blocks * block_size] bool

    @classmethod
    def make(cls, md: AttentionMetadata, rows: np.ndarray, block_size: int, device: torch.device) -> DecodePlan:
        n = len(rows)
        seq_lens = md.seq_lens_np[rows]
        max_blocks = int(-(-seq_lens.max() // block_size))
        host = torch.from_numpy(np.concatenate([md.query_start_loc_np[rows], rows, seq_lens]).astype(np.int64))
        packed = host.to(device)   # (one copy)
        token_idx, rows_t, lens = packed[:n], packed[n:2 * n], packed[2 * n:, None]
        table = md.block_table[:, :max_blocks] if n == md.num_reqs else md.block_table[rows_t, :max_blocks]
        pos = torch.arange(max_blocks * block_size, device=device)
        return cls(block_size, max_blocks, token_idx, table.long().reshape(-1), pos, lens, pos[None, :] >= lens)


def prompt_row_kv(k, v, kv_cache, md, i: int, scales=(1.0, 1.0)) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """Batch row i's token range, its tokens of earlier context, and the keys and values it attends ([S, Hkv, D]):
    the fresh K/V when the row is a whole prompt, else its whole sequence gathered from its cache blocks (in
    the model dtype: a quantized cache is dequantized)."""
    start, end = int(md.query_start_loc_np[i]), int(md.query_start_loc_np[i + 1])
    seq_len = int(md.seq_lens_np[i])
    if seq_len == end - start:
        return start, end, 0, k[start:end], v[start:end]
    blocks = md.block_table[i, : -(-seq_len // kv_cache.shape[2])].long()
    ki = dequantize_kv(kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len], scales[0], k.dtype)
    vi = dequantize_kv(kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len], scales[1], v.dtype)
    return start, end, seq_len - (end - start), ki, vi


def sdpa_prompt_row(q, k, v, kv_cache, md, scale, i: int, out: torch.Tensor, scales=(1.0, 1.0),
                    window: int = 0) -> None:
    """Attention of batch row i's new tokens with SDPA: causal on the fresh K/V, or masked over the gathered
    cache when part of the sequence was computed before (or when a sliding window hides its oldest keys)."""
    start, end, context, ki, vi = prompt_row_kv(k, v, kv_cache, md, i, scales)
    hq, hkv = q.shape[1], kv_cache.shape[3]
    qi, ki, vi = q[start:end].transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)  # [H, tokens, D]
    mask, causal = None, True
    seq_len = context + end - start
    if context or 0 < window < seq_len:
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        query_pos = torch.arange(context, seq_len, device=q.device)[:, None]
        mask, causal = key_pos <= query_pos, False
        if window:
            mask &= key_pos > query_pos - window
    # 4-D inputs reach the fused CPU flash kernel (3-D ones fall back to the math path, ~20x slower);
    # enable_gqa lets the query heads share their KV head without copies.
    o = F.scaled_dot_product_attention(qi[None], ki.to(qi.dtype)[None], vi.to(qi.dtype)[None], attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=hq != hkv)[0]
    out[start:end] = o.transpose(0, 1)
