"""The CPU backend: the native paged-attention kernel for decodes and short chunks after a cached prefix,
SDPA for prompts and long chunks (attention there is a matrix product that oneDNN runs well)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.torch_sdpa import sdpa_prompt_row

# Rows with more new tokens than this go to SDPA (over the gathered cache when a prefix is cached): many query
# rows make attention a matrix product, which oneDNN does far better than the kernel's row-by-row dots.
KERNEL_MAX_QUERY_LEN = 8


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        from tokenmill.kernels.build import load_cpu_kernels

        if not load_cpu_kernels():
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
            sdpa_prompt_row(q, k, v, kv_cache, md, scale, i, out)
        return out

    @staticmethod
    def _plan(md: AttentionMetadata) -> tuple[torch.Tensor | None, list[int]]:
        """Computed once per step, shared by all layers: which rows the kernel takes, which SDPA takes."""
        q_lens = np.diff(md.query_start_loc_np)
        sdpa = (q_lens > KERNEL_MAX_QUERY_LEN) | ((q_lens > 1) & (md.seq_lens_np == q_lens))
        kernel = np.nonzero(~sdpa & (q_lens > 0))[0]
        return (torch.from_numpy(kernel) if len(kernel) else None), np.nonzero(sdpa)[0].tolist()
