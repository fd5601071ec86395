"""One decoder layer of the Llama family: attention (fused q/k/v, optional q/k norms, rope, sliding window)
and the MLP (dense, or `model/moe.py`'s for mixture-of-experts layers)."""

from __future__ import annotations

import torch
from torch import nn

import tokenmill.kernels as kernels
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import ParallelConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.linear import Linear, MergedLinear, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.model.llama_mlp import LlamaMLP
from tokenmill.model.model_config import head_dim_of
from tokenmill.model.moe import moe_block_for


def qkv_rank_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """This tensor-parallel rank's rows of q, k and v in the checkpoint: its share of the query heads, and its
    share of the KV heads (or, with more ranks than KV heads, the one KV head its query heads read)."""
    tp = get_tp()
    q = num_heads // tp.size
    kv = ParallelConfig(tp.size).kv_heads_per_rank(num_kv_heads)
    first_kv = tp.rank * kv if num_kv_heads >= tp.size else tp.rank // (tp.size // num_kv_heads)
    kv_rows = (first_kv * head_dim, kv * head_dim)
    return [(tp.rank * q * head_dim, q * head_dim), kv_rows, kv_rows]


def sliding_window_of(cfg, index: int) -> int:
    """Layer `index`'s sliding window in tokens, 0 for full attention, as transformers decides it: a config with
    `layer_types` (Qwen2, Qwen3, Qwen2-MoE) windows only its "sliding_attention" layers, one without (Mistral,
    Mixtral, Qwen3-MoE) every layer once `sliding_window` is set (their configs leave it unset, or 0, when
    use_sliding_window is off)."""
    window = getattr(cfg, "sliding_window", None) or 0
    layer_types = getattr(cfg, "layer_types", None)
    if window and layer_types is not None and layer_types[index] != "sliding_attention":
        return 0
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, sliding_window: int = 0):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        rows = qkv_rank_rows(cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim)
        self.num_heads, self.num_kv_heads = rows[0][1] // self.head_dim, rows[1][1] // self.head_dim
        model_type = getattr(cfg, "model_type", "llama")
        bias = bool(getattr(cfg, "attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text")
        qkv_bias = bias or qwen2
        q_size, kv_size = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias, parallel="column",
                                     rank_rows=rows if get_tp().size > 1 else None)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bias and not qwen2, parallel="row")
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend, sliding_window)
        self.native = False

    def process_weights_after_loading(self) -> None:
        self.native = kernels.native_kernels_for(self.qkv_proj.weight) and not self.qk_norm
        self.ops = kernels.ops() if self.native else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.native and not self.attn.calibrate:  # (scales are calibrated on the torch path's rotated K)
            out = self._rope_cache_attend(positions, qkv, md)
        else:
            out = self._attend(positions, qkv, md)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def _rope_cache_attend(self, positions: torch.Tensor, qkv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """One native pass rotates q and k and writes K/V into the paged cache (bf16 or quantized), then the
        backend attends."""
        q = torch.empty(qkv.shape[0], self.num_heads, self.head_dim, dtype=qkv.dtype)
        cache = self.attn.kv_cache
        self.ops.rope_and_cache(q, qkv, positions, self.rotary.cos, self.rotary.sin, cache[0], cache[1],
                                md.slot_mapping, self.num_heads, self.num_kv_heads, self.attn.k_scale,
                                self.attn.v_scale, self.attn.k_offset)
        _, k, v = self.qkv_proj.split(qkv)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.attn(q, k, v, md, kv_written=True)

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v, md)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend, rotary, sliding_window_of(cfg, index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = moe_block_for(cfg, index) or LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's MLP output, not yet added into `residual` (None at the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
