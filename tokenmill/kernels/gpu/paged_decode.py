"""Paged decode attention in Triton: one program per (decode row, KV head) attends all the query heads that share
that KV head, over the row's cache blocks, BLOCK_N key positions an iteration with an online softmax in fp32.

It reads only device tensors (the block table and the sequence lengths), never the host, so a decode step that
calls it can be captured in a CUDA graph and replayed with new lengths (worker/cuda_graphs.py). The cache layout
is the engine's: [2, num_blocks, block_size, Hkv, D], any block size; a sliding window skips the keys before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64   # key positions an iteration: several cache blocks of 16, gathered through the block table


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                         stride_kb, stride_ks, stride_kh,
                         scale, window, block_size, head_dim, group,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + row).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < group
    d_ok = d < head_dim
    heads = kv_head * group + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = (first // BLOCK_N) * BLOCK_N
    for base in range(start, seq_len, BLOCK_N):
        pos = base + n
        ok = (pos < seq_len) & (pos >= first)
        block = tl.load(table_ptr + row * stride_tb + pos // block_size, mask=ok, other=0).to(tl.int64)
        offs = block[:, None] * stride_kb + (pos % block_size)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)                   # [N, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                     # [G, N]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)                   # [N, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int = 0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query token per row; kv_cache: [2, N, block_size, Hkv, D] (not quantized);
    block_table: [B, max_blocks]; seq_lens: [B] (each row's keys, its own token included). Returns [B, Hq, D]
    (into `out` when given, which may be a strided view of a larger output)."""
    rows, hq, d = q.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if rows == 0:
        return out
    group = hq // hkv
    k, v = kv_cache[0], kv_cache[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k.stride(3) == 1, "head dimension must be contiguous"
    _paged_decode_kernel[(rows, hkv)](
        q, k, v, out, block_table, seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        k.stride(0), k.stride(1), k.stride(2),
        scale, window, block_size, d, group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N)
    return out
