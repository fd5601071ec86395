"""The reference backend: one request at a time, plain gathers and a causal mask, fp32 math.

Slow on purpose: it is the oracle every faster backend is tested against.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import dequantize_kv


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int = 0) -> torch.Tensor:
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        qsl = md.query_start_loc_np
        for i, seq_len in enumerate(md.seq_lens_np.tolist()):
            start, end = int(qsl[i]), int(qsl[i + 1])
            if end == start:
                continue
            q_len = end - start
            blocks = md.block_table[i, : (seq_len + block_size - 1) // block_size].long()
            k = dequantize_kv(kv_cache[0, blocks], k_scale, torch.float32)
            v = dequantize_kv(kv_cache[1, blocks], v_scale, torch.float32)
            k = k.reshape(-1, num_kv_heads, q.shape[2])[:seq_len].float()
            v = v.reshape(-1, num_kv_heads, q.shape[2])[:seq_len].float()
            k = k.repeat_interleave(group, dim=1)          # [S, Hq, D]
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,shd->hqs", q[start:end].float(), k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            hidden = k_pos > q_pos
            if window:
                hidden |= k_pos <= q_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)
        return out
