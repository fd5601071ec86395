"""LoRA inside a linear layer, batched over adapters: every resident adapter has a slot, and a step computes
all of its rows' LoRA products in three ops whatever the mix of adapters:

    h = x @ A_all.T        one shrink matmul over the slots in play ([T, slots * shards * r])
    h *= mask              each token keeps only its own slot's columns (a [T, slots, 1] 0/1 mask per step)
    y += h @ B_all         one expand matmul; B holds each shard's rows (q/k/v, gate/up) at its offset

A token of the base model has an all-zero mask row and gets y unchanged (exact zeros are added). No weight is
ever merged, so requests of different adapters and of the base model share the step's one base matmul.

In bf16 on the CPU the native `lora_sgmv` kernel does the same in one op, with the step's adapted tokens
grouped by slot: each token reads only its own adapter's rows, four tokens per weight load (the torch path
multiplies every token by every slot in play)."""

from __future__ import annotations

import torch

import tokenmill.kernels as kernels


class LoRAStep:
    """The step's token -> slot mask, shared by every adapted layer; None when no token uses an adapter."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None   # [T, slots in play, 1], model dtype
        self.order: torch.Tensor | None = None   # int32: the adapted tokens grouped by slot (the native kernel's)
        self.seg: torch.Tensor | None = None     # int32 [slots + 1]: slot s's tokens are order[seg[s]:seg[s+1]]
        self.slots = 0


class LoRALinearWeights:
    """The stacked A and B of every slot for one linear layer (with `shards` fused projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, rank: int, step: LoRAStep,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.step = step
        self.rank = rank
        self.num_shards = len(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_sizes = out_sizes
        width = max_loras * self.num_shards * rank
        self.native = kernels.native_kernels_for(torch.empty(0, dtype=dtype, device=device)) and \
            self.num_shards * rank <= 64
        self.a = torch.zeros(width, in_features, dtype=dtype, device=device)          # rows: slot, shard, rank
        self.b_t = torch.zeros(width, sum(out_sizes), dtype=dtype, device=device)     # B transposed, same rows
        # the kernel's copies, in fp32 (no conversion in its inner loops; adapters are small)
        self.a32 = self.a.float() if self.native else None
        self.b32 = self.b_t.float() if self.native else None
        self.bounds = [*self.offsets, sum(out_sizes)]

    def _rows(self, slot: int, shard: int) -> int:
        return (slot * self.num_shards + shard) * self.rank

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` takes an adapter's (A [r, in], B [out, r]) per shard; shards it does not target stay zero."""
        self.clear_slot(slot)
        for shard, (a, b) in shards.items():
            row, r = self._rows(slot, shard), a.shape[0]
            off, size = self.offsets[shard], self.out_sizes[shard]
            for a_all, b_all in self._copies():
                a_all[row:row + r].copy_(a)
                b_all[row:row + r, off:off + size].copy_(b.t())

    def clear_slot(self, slot: int) -> None:
        first, last = self._rows(slot, 0), self._rows(slot + 1, 0)
        for a_all, b_all in self._copies():
            a_all[first:last].zero_()
            b_all[first:last].zero_()

    def _copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.a, self.b_t)] + ([(self.a32, self.b32)] if self.native else [])

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each token's own adapter's product."""
        mask = self.step.mask
        if mask is None:
            return y
        if self.native and x.dim() == 2 and x.stride(1) == 1 and y.is_contiguous():
            torch.ops.tokenmill.lora_sgmv(y, x, self.a32, self.b32, self.step.order, self.step.seg, self.bounds,
                                          self.rank)
            return y
        width = self.step.slots * self.num_shards * self.rank
        h = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.a[:width])
        h = (h.view(h.shape[0], self.step.slots, -1) * mask).view(h.shape[0], width)
        return y.view(-1, y.shape[-1]).addmm_(h, self.b_t[:width]).view(y.shape)
