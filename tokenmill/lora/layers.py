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

import numpy as np
import torch

import tokenmill.kernels as kernels


class LoRAStep:
    """Each token's slot this step (-1: the base model), shared by every adapted layer; inactive when no token uses
    an adapter. The forms the two paths read are made on first use, once a step."""

    def __init__(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        self.dtype, self.device = dtype, device
        self.token_slot: np.ndarray | None = None
        self.slots = 0   # slots in play: 0..slots-1
        self._mask: torch.Tensor | None = None
        self._grouped: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.token_slot is not None

    def begin(self, token_slot: np.ndarray) -> None:
        self.token_slot, self.slots = token_slot, int(token_slot.max()) + 1
        self._mask = self._grouped = None

    def end(self) -> None:
        self.token_slot = self._mask = self._grouped = None

    def mask(self) -> torch.Tensor:
        """[T, slots, 1] 0/1 in the model dtype: the torch path's."""
        if self._mask is None:
            mask = np.zeros((len(self.token_slot), self.slots), dtype=np.float32)
            rows = np.flatnonzero(self.token_slot >= 0)
            mask[rows, self.token_slot[rows]] = 1.0
            self._mask = torch.from_numpy(mask).to(self.device, self.dtype).unsqueeze(-1)
        return self._mask

    def grouped(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, seg), int32: the adapted tokens grouped by slot, slot s's at order[seg[s]:seg[s+1]] (the
        kernel's)."""
        if self._grouped is None:
            slot = self.token_slot
            order = np.argsort(np.where(slot < 0, self.slots, slot), kind="stable")[:np.count_nonzero(slot >= 0)]
            seg = np.searchsorted(slot[order], np.arange(self.slots + 1))
            self._grouped = torch.from_numpy(order.astype(np.int32)), torch.from_numpy(seg.astype(np.int32))
        return self._grouped


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
            kernels.has_op("lora_sgmv") and self.num_shards * rank <= 64
        self.ops = kernels.ops() if self.native else None
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
        if not self.step.active:
            return y
        if self.native and x.dim() == 2 and x.stride(1) == 1 and y.is_contiguous():
            order, seg = self.step.grouped()
            self.ops.lora_sgmv(y, x, self.a32, self.b32, order, seg, self.bounds, self.rank)
            return y
        width = self.step.slots * self.num_shards * self.rank
        h = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.a[:width])
        h = (h.view(h.shape[0], self.step.slots, -1) * self.step.mask()).view(h.shape[0], width)
        return y.view(-1, y.shape[-1]).addmm_(h, self.b_t[:width]).view(y.shape)
