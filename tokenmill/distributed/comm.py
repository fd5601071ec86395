"""The collectives the model needs, each a no-op in a group of one (so one process never touches
torch.distributed)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tokenmill.distributed.parallel_state import get_pp, get_tp

# seconds spent in tensor-parallel collectives since the worker last collected them (for --profile)
collective_seconds = 0.0


def take_collective_seconds() -> float:
    global collective_seconds
    seconds, collective_seconds = collective_seconds, 0.0
    return seconds


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums the partial results of a row-parallel layer over the tensor-parallel group, in place."""
    global collective_seconds
    tp = get_tp()
    if tp.size == 1:
        return x
    t0 = time.perf_counter()
    if tp.size == 2:
        _exchange_add(x, tp.ranks[1 - tp.rank], tp.group)
    else:
        dist.all_reduce(x, group=tp.group)
    collective_seconds += time.perf_counter() - t0
    return x


def _exchange_add(x: torch.Tensor, peer: int, group) -> None:
    """The all-reduce of two ranks as one exchange and an add: with gloo on this CPU 4x faster than its
    all_reduce (230 vs 900 us for a decode step's 1 KB; its ring makes several round trips). Both ranks end
    with the same bits: a + b == b + a in floating point."""
    other = torch.empty_like(x)
    work = dist.isend(x, dst=peer, group=group)
    dist.recv(other, src=peer, group=group)
    work.wait()
    x += other


def tp_gather(x: torch.Tensor, full_size: int) -> torch.Tensor | None:
    """The vocabulary shards of the logits, concatenated on the first tensor-parallel rank (None on the others)
    and trimmed of the padding that made the vocabulary divisible."""
    tp = get_tp()
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.is_first else None
    dist.gather(x, parts, dst=tp.ranks[0], group=tp.group)
    return torch.cat(parts, dim=-1)[..., :full_size] if tp.is_first else None


def pp_send(tensors: list[torch.Tensor]) -> list:
    """Hidden states to the next pipeline stage (the same tensor-parallel rank there), without waiting: the
    caller waits on the returned works (and keeps the tensors alive until then)."""
    pp = get_pp()
    works = []
    for t in tensors:
        t = t.contiguous()
        works.append(_Pending(dist.isend(t, dst=pp.ranks[pp.rank + 1], group=pp.group), t))
    return works


class _Pending:
    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    pp = get_pp()
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=pp.ranks[pp.rank - 1], group=pp.group)
        out.append(t)
    return out
