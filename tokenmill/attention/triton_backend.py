"""The GPU backend: decode rows on the Triton paged decode kernel (kernels/gpu/paged_decode.py), prompt rows on
SDPA as in torch_sdpa. A step of decode rows alone reads no host array and no value from the device, which is
what lets worker/cuda_graphs.py capture it; a quantized cache (fp8/int8) takes torch_sdpa's decode instead."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import is_quantized_kv
from tokenmill.attention.torch_sdpa import TorchSdpaBackend, sdpa_prompt_row


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        from tokenmill.kernels.gpu.paged_decode import paged_decode_attention

        self._decode = paged_decode_attention
        self._fallback = TorchSdpaBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int = 0) -> torch.Tensor:
        if is_quantized_kv(kv_cache):
            return self._fallback.forward(q, k, v, kv_cache, md, scale, k_scale, v_scale, window)
        if md.max_query_len == 1:   # every row decodes, row i is token i: the graph-capturable step
            return self._decode(q, kv_cache, md.block_table, md.seq_lens, scale, window)
        out = torch.empty_like(q)
        q_lens = np.diff(md.query_start_loc_np)
        rows = np.nonzero(q_lens == 1)[0]
        if len(rows):
            plan = md.backend_plan.get(self.name)
            if plan is None:   # (the same in every layer of the step)
                idx = torch.from_numpy(np.concatenate([md.query_start_loc_np[rows], rows])).to(q.device)
                plan = md.backend_plan[self.name] = (idx[:len(rows)], idx[len(rows):])
            tokens, req_rows = plan
            o = self._decode(q.index_select(0, tokens), kv_cache, md.block_table.index_select(0, req_rows),
                             md.seq_lens.index_select(0, req_rows), scale, window)
            out.index_copy_(0, tokens, o)
        for i in np.nonzero(q_lens > 1)[0].tolist():
            sdpa_prompt_row(q, k, v, kv_cache, md, scale, i, out, (k_scale, v_scale), window)
        return out
