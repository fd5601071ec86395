"""Process groups of one rank: the world, its tensor-parallel group and its pipeline group.

Ranks are laid out as rank = pipeline stage * tensor_parallel_size + tensor-parallel rank, as in vLLM. Before
`init_distributed` (one process, no torch.distributed) every group is a group of one, so the model code asks the
same questions either way."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class GroupInfo:
    rank: int                  # this process's index in the group
    size: int
    ranks: tuple[int, ...]     # the group's global ranks, in group order
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


_SINGLE = GroupInfo(0, 1, (0,))
_world, _tp, _pp = _SINGLE, _SINGLE, _SINGLE
_expert_parallel = False


def expert_parallel_enabled() -> bool:
    """Whether mixture-of-experts layers give each tensor-parallel rank whole experts."""
    return _expert_parallel


def get_world() -> GroupInfo:
    return _world


def get_tp() -> GroupInfo:
    return _tp


def get_pp() -> GroupInfo:
    return _pp


def init_distributed(rank: int, tp: int, pp: int, init_method: str, backend: str = "gloo",
                     expert_parallel: bool = False, timeout_s: float = 1800.0) -> None:
    """Joins the world and builds every tensor- and pipeline-parallel group (each rank must create all of them,
    in the same order). A peer that dies makes the next collective raise, so no rank waits for the timeout."""
    global _world, _tp, _pp, _expert_parallel
    _expert_parallel = expert_parallel
    world_size = tp * pp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _world = GroupInfo(rank, world_size, tuple(range(world_size)), dist.group.WORLD)
    for stage in range(pp):
        ranks = tuple(stage * tp + t for t in range(tp))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            _tp = GroupInfo(ranks.index(rank), tp, ranks, group)
    for t in range(tp):
        ranks = tuple(stage * tp + t for stage in range(pp))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            _pp = GroupInfo(ranks.index(rank), pp, ranks, group)


def destroy_distributed() -> None:
    global _world, _tp, _pp, _expert_parallel
    if dist.is_initialized():
        dist.destroy_process_group()
    _world, _tp, _pp, _expert_parallel = _SINGLE, _SINGLE, _SINGLE, False


def output_rank(tp: int, pp: int) -> int:
    """The rank that samples: the last pipeline stage's first tensor-parallel rank."""
    return (pp - 1) * tp
