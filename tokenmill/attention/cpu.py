"""The CPU backend: the native paged-attention kernel for decodes and short chunks after a cached prefix;
prompts and long chunks (attention there is a matrix product) in bf16 on the native prompt kernel, on AMX tiles
where the CPU has AMX and with AVX-512 BF16 elsewhere; SDPA's flash attention for other dtypes and shapes.

Shared-prefix ("cascade") attention: when the requests that continue from cached context all start with the
same blocks (a common system prompt, W3's shared document), the prefix is attended once for all their new
tokens as one matrix-product attention (every query against the prefix's keys), the kernel attends each
request's own tail, and the two partial results are merged by their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import tokenmill.kernels as kernels
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.attention.ops import dequantize_kv
from tokenmill.attention.torch_sdpa import prompt_row_kv, sdpa_prompt_row

# Rows with more new tokens than this go to SDPA (over the gathered cache when a prefix is cached): many query
# rows make attention a matrix product, which oneDNN does far better than the kernel's row-by-row dots.
KERNEL_MAX_QUERY_LEN = 8
# Cascade only pays when the shared prefix is long and shared by enough decoding requests.
CASCADE_MIN_ROWS = 8
CASCADE_MIN_TOKENS = 256
# Rows with more new tokens than this keep to SDPA even when they share the prefix (their tails are long).
CASCADE_MAX_QUERY_LEN = 128


@dataclass
class SharedPrefix:
    num_blocks: int
    block_ids: torch.Tensor     # [num_blocks] int64, the same leading blocks of every kernel row
    token_index: torch.Tensor   # [N] every new token of the kernel rows
    all_tokens: bool            # token_index is every token of the step, in order
    first_block: int | None     # the blocks are first_block, first_block + 1, ...: a view, no gather


@dataclass
class CpuPlan:
    kernel_rows: torch.Tensor | None
    sdpa_rows: list[int]
    prefix: SharedPrefix | None
    # the sdpa rows as a native stack takes them, [n, 4] int64 rows of (start, end, batch row, cached context):
    # made by native_plan, once a step
    prompt_spans: torch.Tensor | None = None


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        self._ops = kernels.ops()
        if self._ops is None:
            raise RuntimeError("the native CPU attention kernel could not be built (or --cpu-isa none)")
        self._op = self._ops.paged_attention
        self._prefill_op = kernels.prefill_attention_op()
        self.decode_amx = True   # bf16 decode scores on AMX tiles where the CPU has them (tests turn it off)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int = 0) -> torch.Tensor:
        if window >= md.max_seq_len:
            window = 0  # no sequence of this step reaches past the window: full attention is the same
        key = f"{self.name}/window" if window else self.name  # a window leaves no prefix that every token sees
        plan = md.backend_plan.get(key)
        if plan is None:
            plan = md.backend_plan[key] = self._plan(md, kv_cache.shape[2], cascade=not window)
        out = torch.empty_like(q)
        scales = (k_scale, v_scale)
        if plan.prefix is not None:
            self._cascade(out, q, kv_cache, md, plan, scale, scales)
        elif plan.kernel_rows is not None:
            self._op(out, q, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, md.query_start_loc,
                     plan.kernel_rows, scale, 0, None, k_scale, v_scale, window, self.decode_amx)
        for i in plan.sdpa_rows:
            if window or not self._prefill_takes(q):  # (the native prompt kernels have no window)
                sdpa_prompt_row(q, k, v, kv_cache, md, scale, i, out, scales, window)
            else:
                native_prompt_row(self._prefill_op, q, k, v, kv_cache, md, scale, i, out, scales)
        return out

    def native_plan(self, md: AttentionMetadata, block_size: int, prompts: bool,
                    cached_keys: bool) -> CpuPlan | None:
        """The plan of a step of full attention for a native decoder stack to run: the paged kernel's rows, and
        only where the stack runs them itself: rows for SDPA or the prompt kernels (`prompts`: whole prompts),
        and work that reads keys from the cache on the prompt kernel (`cached_keys`: a shared prefix, prompt
        chunks after cached context); else None."""
        plan = md.backend_plan.get(self.name)
        if plan is None:
            plan = md.backend_plan[self.name] = self._plan(md, block_size)
        if plan.prefix is not None and not cached_keys:
            return None
        if plan.sdpa_rows:
            if not prompts:
                return None
            if plan.prompt_spans is None:
                rows = np.asarray(plan.sdpa_rows)
                start, end = md.query_start_loc_np[rows], md.query_start_loc_np[rows + 1]
                plan.prompt_spans = torch.from_numpy(
                    np.stack([start, end, rows, md.seq_lens_np[rows] - (end - start)], axis=1).astype(np.int64))
            if not cached_keys and bool(plan.prompt_spans[:, 3].any()):   # a chunk after cached context
                return None
        elif plan.kernel_rows is None:
            return None
        return plan

    def native_prompts(self, head_dim: int) -> bool:
        """Whether a native stack may run prompt rows as native_prompt_row does: the prompt kernel takes them
        (bf16, head_dim 64). A whole prompt's keys are this step's own, whatever the cache's dtype."""
        return self._prefill_op is not None and head_dim == 64

    def native_cached_keys(self, kv_cache: torch.Tensor, head_dim: int) -> bool:
        """Whether a native stack may read keys from the cache as _cascade and native_prompt_row do (a shared
        prefix, a chunk after cached context): the prompt kernel takes them and the cache holds bf16 (no
        dequantizing)."""
        return self.native_prompts(head_dim) and kv_cache.dtype == torch.bfloat16

    def _prefill_takes(self, q: torch.Tensor) -> bool:
        """The native prompt kernels' domain: bf16, head_dim 64, on a CPU with AMX or AVX-512 BF16."""
        return self._prefill_op is not None and q.dtype == torch.bfloat16 and q.shape[2] == 64

    def _cascade(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                 plan: CpuPlan, scale: float, scales=(1.0, 1.0)) -> None:
        prefix = plan.prefix
        lse_tail = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
        self._op(out, q, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, md.query_start_loc,
                 plan.kernel_rows, scale, prefix.num_blocks, lse_tail, scales[0], scales[1], 0, self.decode_amx)
        rows, (hq, d), hkv = prefix.token_index.shape[0], q.shape[1:], kv_cache.shape[3]  # rows: query tokens
        group = hq // hkv
        qr = q if prefix.all_tokens else q[prefix.token_index]
        kp, vp = (dequantize_kv(_prefix_keys(kv_cache[i], prefix), scales[i], q.dtype)
                  for i in (0, 1))   # [blocks, block_size, Hkv, D]
        if self._prefill_takes(q):
            o_pre = torch.empty(rows, hq, d, dtype=q.dtype)
            lse_pre = torch.empty(rows, hq, dtype=torch.float32)
            self._prefill_op(o_pre, qr, kp.flatten(0, 1), vp.flatten(0, 1), scale, 0, False, lse_pre)
            o_pre, lse_pre = o_pre.view(rows, hkv, group, d), lse_pre.view(rows, hkv, group)
        else:  # flash attention with the queries grouped by KV head: [1, Hkv, R * group, D] against [1, Hkv, S, D]
            qh = qr.view(rows, hkv, group, d).transpose(0, 1).reshape(1, hkv, rows * group, d)
            kh, vh = (t.view(-1, hkv, d).transpose(0, 1).unsqueeze(0) for t in (kp, vp))
            o_pre, lse_pre = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, scale=scale)
            o_pre = o_pre.view(hkv, rows, group, d).permute(1, 0, 2, 3)
            lse_pre = lse_pre.view(hkv, rows, group).permute(1, 0, 2)
        self._ops.merge_attn_states(out, lse_tail, o_pre, lse_pre, prefix.token_index)

    @staticmethod
    def _plan(md: AttentionMetadata, block_size: int, cascade: bool = True) -> CpuPlan:
        """Computed once per step, shared by all layers (of one kind: full or sliding-window attention): which
        rows the kernel takes, which SDPA takes, and the prefix blocks the kernel rows share, if they share one."""
        q_lens = np.diff(md.query_start_loc_np)
        context = md.seq_lens_np - q_lens  # tokens before this step's new ones
        fresh = (q_lens > 1) & (context == 0)
        group = np.nonzero(~fresh & (q_lens > 0) & (q_lens <= CASCADE_MAX_QUERY_LEN))[0]
        prefix = (_shared_prefix(md, group, context, block_size) if cascade and len(group) >= CASCADE_MIN_ROWS
                  else None)
        if prefix is not None:
            kernel, sdpa = group, np.setdiff1d(np.nonzero(q_lens > 0)[0], group)
        else:
            kernel = np.nonzero((q_lens > 0) & (q_lens <= KERNEL_MAX_QUERY_LEN) & ~fresh)[0]
            sdpa = np.nonzero((q_lens > KERNEL_MAX_QUERY_LEN) | fresh)[0]
        return CpuPlan(torch.from_numpy(kernel) if len(kernel) else None, sdpa.tolist(), prefix)


def _shared_prefix(md: AttentionMetadata, rows: np.ndarray, context: np.ndarray,
                   block_size: int) -> SharedPrefix | None:
    # only full blocks that lie before every row's first new token: all new tokens see the whole prefix
    limit = int(context[rows].min()) // block_size
    if limit * block_size < CASCADE_MIN_TOKENS:
        return None
    table = md.block_table[torch.from_numpy(rows), :limit].numpy()
    same = (table == table[0]).all(axis=0)
    n = limit if same.all() else int(np.argmin(same))
    if n * block_size < CASCADE_MIN_TOKENS:
        return None
    qsl = md.query_start_loc_np
    lens = qsl[rows + 1] - qsl[rows]
    tokens = np.repeat(qsl[rows] - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
    ids = table[0, :n].astype(np.int64)
    consecutive = bool((np.diff(ids) == 1).all())
    return SharedPrefix(n, torch.from_numpy(ids), torch.from_numpy(tokens), len(tokens) == qsl[-1],
                        int(ids[0]) if consecutive else None)


def _prefix_keys(cache: torch.Tensor, prefix: SharedPrefix) -> torch.Tensor:
    """The prefix's blocks of one K or V cache: a view when they lie in order (the usual case: a prompt's
    blocks are handed out together), else a gathered copy."""
    if prefix.first_block is not None:
        return cache.narrow(0, prefix.first_block, prefix.num_blocks)
    return cache.index_select(0, prefix.block_ids)


def native_prompt_row(op, q, k, v, kv_cache, md, scale, i: int, out: torch.Tensor, scales=(1.0, 1.0)) -> None:
    """sdpa_prompt_row on a native prompt kernel (bf16, head_dim 64): on AMX tiles 1.6-1.9x torch's flash
    attention on prompts (Intel Xeon); with AVX-512 BF16 4-6x (AMD Zen 5, where torch's runs MKL's fp32 sgemm)."""
    start, end, context, ki, vi = prompt_row_kv(k, v, kv_cache, md, i, scales)
    if ki.stride(0) != vi.stride(0):   # rotated K of its own beside V still in the qkv output: one stride for both
        ki, vi = ki.contiguous(), vi.contiguous()
    op(out[start:end], q[start:end], ki, vi, scale, context)
