"""The KV offload tier, worker side: the contents of offloaded blocks, in host RAM and optionally on disk.

It decides nothing; each step's OffloadOps (from the scheduler's OffloadIndex) say what to copy. A block is kept
as one tensor of all this rank's layers, [layers, 2, block_size, kv_heads, head_dim] in the cache's dtype; on disk
as those raw bytes in a file named by its key."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.core.kv_offload import OffloadOps


class KVOffloadStore:
    def __init__(self, kv_caches: list[torch.Tensor], folder: str | None = None):
        self.kv_caches = kv_caches
        self.ram: dict[bytes, torch.Tensor] = {}
        self.folder = Path(folder) if folder else None
        first = kv_caches[0]
        self.shape = (len(kv_caches), first.shape[0], *first.shape[2:])
        self.dtype = first.dtype

    def apply(self, ops: OffloadOps) -> None:
        for op in ops.ops:
            kind = op[0]
            if kind == "save":
                _, block_id, key = op
                self.ram[key] = torch.stack([cache[:, block_id] for cache in self.kv_caches]).cpu()   # (a copy)
            elif kind == "load":
                _, key, block_id = op
                data = self.ram.get(key)
                data = (data if data is not None else self._read(key)).to(self.kv_caches[0].device)
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id].copy_(data[layer])
            elif kind == "spill":
                self.ram.pop(op[1]).contiguous().view(torch.uint8).numpy().tofile(self._path(op[1]))
            elif op[2] == "ram":
                del self.ram[op[1]]
            else:
                self._path(op[1]).unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def _read(self, key: bytes) -> torch.Tensor:
        import numpy as np

        raw = torch.from_numpy(np.fromfile(self._path(key), dtype=np.uint8))
        return raw.view(self.dtype).reshape(self.shape)
