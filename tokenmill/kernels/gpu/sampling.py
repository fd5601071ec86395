"""Temperature sampling in one Triton kernel: a program per row reads the row's logits twice (the softmax's
maximum and sum, then the running sum up to the draw), where the torch sampler makes [rows, vocab] fp32
probabilities, their cumulative sums and a search (four kernels and two full-size temporaries).

It draws as Sampler.draw does: the first token whose running sum of exp((logit - max) / T) passes u times the
row's sum, u uniform in [0, 1) and given by the caller (so a seeded request's stream is the same either way).
Only the summation order differs: where u times the sum lies within float error of a token's boundary the two
may pick neighbours (the test detects exactly that case).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, u_ptr, out_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride_row
    inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m = tl.maximum(m, x)
    top = tl.max(m, axis=0)
    total = 0.0
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_t
        total += tl.sum(tl.exp(x - top), axis=0)
    target = tl.load(u_ptr + row) * total
    running = 0.0
    chosen = V - 1
    found = 0
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(x - top)
        cum = running + tl.cumsum(p, axis=0)
        passed = (cum > target) & (p > 0) & (v0 + cols < V)
        first = tl.min(tl.where(passed, v0 + cols, V), axis=0)
        take = (found == 0) & (first < V)
        chosen = tl.where(take, first, chosen)
        found = tl.where(take, 1, found)
        running += tl.sum(p, axis=0)
    tl.store(out_ptr + row, chosen.to(tl.int64))


def sample_with_temperature(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] (rows contiguous); temperature: [B] (> 0); u: [B] uniform in [0, 1). Returns [B] int64."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _sample_kernel[(rows,)](logits, temperature.float(), u.float(), out, vocab, logits.stride(0),
                                BLOCK_V=BLOCK_V)
    return out
