"""Applying packed token bitmasks to logits rows: the native kernel when built, else torch (the reference)."""

from __future__ import annotations

import functools

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 -> [R, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@functools.lru_cache(maxsize=1)
def _native() -> bool:
    import tokenmill.kernels as kernels  # not at import: the API process never builds the kernels

    return kernels.has_op("apply_token_bitmask")


def _ops():
    import tokenmill.kernels as kernels

    return kernels.ops()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, at every token the row's mask forbids; logits row rows[i] takes mask row i."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2
            and logits.stride(1) == 1 and _native()):
        _ops().apply_token_bitmask(logits, rows.to(torch.int64).contiguous(), bitmask.contiguous())
    else:
        apply_token_bitmask_torch(logits, rows, bitmask)
