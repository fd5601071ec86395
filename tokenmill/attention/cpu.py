"""The CPU backend: the native paged-attention kernel for every row that reads cached K/V (decodes, chunks
after a prefix), SDPA for fresh prompts (a plain causal attention that oneDNN runs as matmuls)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.torch_sdpa import TorchSdpaBackend


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        from tokenmill.attention.cpu_ext import load_cpu_extension

        if not load_cpu_extension():
            raise RuntimeError("the native CPU attention kernel could not be built")
        self._op = torch.ops.tokenmill.paged_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = md.backend_plan.get(self.name)
        if plan is None:
            plan = md.backend_plan[self.name] = self._plan(md)
        kernel_rows, fresh_rows = plan
        out = torch.empty_like(q)
        if kernel_rows is not None:
            self._op(out, q, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, md.query_start_loc, kernel_rows,
                     scale)
        for i in fresh_rows:
            TorchSdpaBackend._prefill(q, k, v, kv_cache, md, scale, i, out)
        return out

    @staticmethod
    def _plan(md: AttentionMetadata) -> tuple[torch.Tensor | None, list[int]]:
        """Computed once per step, shared by all layers: which rows the kernel takes, which SDPA takes."""
        q_lens = np.diff(md.query_start_loc_np)
        fresh = (q_lens > 1) & (md.seq_lens_np == q_lens)
        kernel = np.nonzero(~fresh & (q_lens > 0))[0]
        return (torch.from_numpy(kernel) if len(kernel) else None), np.nonzero(fresh)[0].tolist()
