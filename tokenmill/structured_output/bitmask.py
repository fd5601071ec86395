"""Applying packed token bitmasks to logits rows."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 -> [R, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, at every token the row's mask forbids; logits row rows[i] takes mask row i."""
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
