"""The KV offload tier, scheduler side: which evicted blocks host RAM (and optionally disk) still hold.

A cached block that an allocation evicts from the device cache is copied out first, keyed by its block hash,
instead of being lost. A later prompt whose prefix continues past the device cache's hits finds the next blocks
here; they are copied back into free plain blocks of the device cache and from then on are ordinary cached
blocks. The tier is inclusive: a block copied back stays in it, so evicting it again needs no copy.

This index decides everything (what to keep, in LRU order within each tier's capacity); the worker's store only
obeys the ops a step carries, so both stay the same without talking. A step's ops run before its forward, in
the order the index made them (a key may be dropped from disk and saved again within one schedule).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.block_hash import BlockHash


@dataclass
class OffloadOps:
    """What the worker does to the tier at the start of a step, in order: ("save", block_id, key) copies a device
    block into RAM, ("load", key, block_id) copies one back (from RAM or disk), ("spill", key) moves one from RAM
    to disk, ("drop", key, tier) forgets one ("ram" or "disk")."""
    ops: list[tuple] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ops)


@dataclass
class OffloadStats:
    saved_blocks: int = 0
    loaded_blocks: int = 0


class OffloadIndex:
    def __init__(self, ram_blocks: int, disk_blocks: int = 0):
        if ram_blocks < 1:
            raise ValueError(f"kv_offload_bytes must hold at least one block, got room for {ram_blocks}")
        self.ram_blocks, self.disk_blocks = ram_blocks, disk_blocks
        self.ram: OrderedDict[bytes, BlockHash] = OrderedDict()    # least recently used first
        self.disk: OrderedDict[bytes, BlockHash] = OrderedDict()
        self.ops = OffloadOps()
        self.stats = OffloadStats()

    def __len__(self) -> int:
        return len(self.ram) + len(self.disk)

    def find(self, block_hash: BlockHash) -> bool:
        """Whether the tier holds this block (its token ids compared too: no collision is trusted)."""
        for tier in (self.ram, self.disk):
            held = tier.get(block_hash.value)
            if held is not None:
                tier.move_to_end(block_hash.value)
                return held == block_hash
        return False

    def evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached device block is about to be reused: keep its contents unless the tier has them already."""
        # (a block copied back this step and evicted again needs nothing: its load runs first, in order)
        ops = self.ops.ops
        if self.find(block_hash):
            return
        self.ram[block_hash.value] = block_hash
        ops.append(("save", block_id, block_hash.value))
        self.stats.saved_blocks += 1
        while len(self.ram) > self.ram_blocks:
            key, h = self.ram.popitem(last=False)
            if self.disk_blocks:
                self.disk[key] = h
                ops.append(("spill", key))
            else:
                ops.append(("drop", key, "ram"))
        while len(self.disk) > self.disk_blocks:
            ops.append(("drop", self.disk.popitem(last=False)[0], "disk"))

    def restore(self, block_hash: BlockHash, block_id: int) -> None:
        self.ops.ops.append(("load", block_hash.value, block_id))
        self.stats.loaded_blocks += 1

    def take_ops(self) -> OffloadOps | None:
        ops, self.ops = self.ops, OffloadOps()
        return ops or None
