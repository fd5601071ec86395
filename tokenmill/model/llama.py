"""The Llama family in one file: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (RMSNorm on q and k), and their
mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (the MLP is then `model/moe.py`'s).

Differences are config fields, not subclasses. q/k/v and gate/up are fused into single matmuls at load.
Tensor parallel: q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (one all-reduce
each), the embedding and lm head split the vocabulary. Pipeline parallel: a rank builds only its stage's layers;
the first stage embeds, the last one norms and computes logits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import tokenmill.kernels as kernels
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import ParallelConfig
from tokenmill.distributed.comm import tp_gather
from tokenmill.distributed.parallel_state import get_pp, get_tp
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.linear import Embedding, Linear, MergedLinear, RMSNorm
from tokenmill.layers.quant import UnquantizedMethod
from tokenmill.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.model.model_config import head_dim_of
from tokenmill.model.native_stack import NativeDecoderStack

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# checkpoint sub-name -> (fused parameter sub-name, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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
        qwen2 = model_type in ("qwen2", "qwen2_moe")
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
        torch.ops.tokenmill.rope_and_cache(q, qkv, positions, self.rotary.cos, self.rotary.sin, cache[0], cache[1],
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


class LlamaMLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter] * 2, bias=bias, parallel="column")
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias, parallel="row")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.is_silu = act == "silu"
        self.native = False
        self.gated = None  # the gate/up kernel's fused silu-and-mul, where it has one

    def process_weights_after_loading(self) -> None:
        """After gate_up_proj's own (its kernel decides whether a fused gated path exists)."""
        self.native = self.is_silu and kernels.native_kernels_for(self.gate_up_proj.weight)
        self.gated = getattr(self.gate_up_proj.kernel, "silu_and_mul", None) if self.native else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None and not self.gate_up_proj.lora_active:
            h = self.gated(x)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.native and gate_up.dim() == 2:
            h = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            torch.ops.tokenmill.silu_and_mul(h, gate_up)
            return self.down_proj(h)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, index: int):
        from tokenmill.model.moe import moe_block_for

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


class LlamaModel(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int):
        super().__init__()
        pp = get_pp()
        self.stage = ParallelConfig(pipeline_parallel_size=pp.size).stage_layers(cfg.num_hidden_layers, pp.rank)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = (Embedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first or (tied and pp.is_last)
                             else None)
        # one rope table for all layers (not a registered child of each, so it is built and stored once)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg))
        # other stages' layers are placeholders, so layer i keeps its checkpoint name model.layers.i
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, self.rotary, i) if i in self.stage
                                    else nn.Identity() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        # an EAGLE-3 head reads the residual stream entering these layers (vLLM's aux hidden states)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: dict[int, torch.Tensor] = {}
        self.native_stack: NativeDecoderStack | None = NativeDecoderStack(self)  # None: --enforce-eager

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states after the final norm; on a pipeline stage before the last, the (x, residual) pair that
        the next stage continues from (`intermediate` is what a later stage received)."""
        if intermediate is None and self.native_stack is not None:
            out = self.native_stack.forward(input_ids, positions, md)
            if out is not None:   # (a step with auxiliary hidden states to keep never gets here)
                self.aux_hidden_states = {}
                return out
        x, residual = intermediate if intermediate is not None else (self.embed_tokens(input_ids), None)
        aux = {}
        for i in self.stage:
            if i in self.aux_hidden_state_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = self.layers[i](positions, x, residual, md)
        self.aux_hidden_states = aux
        if self.norm is None:
            return x, residual
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """forward() gives hidden states for every scheduled token; compute_logits() only where the runner asks."""

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, max_positions)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.last_stage = get_pp().is_last
        if not self.last_stage:
            self.lm_head = None
        else:
            self.lm_head = (self.model.embed_tokens if self.tied
                            else Linear(cfg.hidden_size, cfg.vocab_size, parallel="column"))
        self.lm_head_method = UnquantizedMethod()  # the loader attaches the engine's choice for the head
        self.logits_head = None

    def process_weights_after_loading(self) -> None:
        for module in reversed(list(self.modules())):  # children first: a parent may read their kernels
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        if not self.last_stage:
            self.logits_head = None
        elif self.tied:  # the head gets its own copy of the embedding, packed or quantized
            self.logits_head = self.lm_head_method.make_kernel("lm_head", self.lm_head.weight, None,
                                                               self.lm_head.quantized)
            self.lm_head.quantized = None
        else:
            self.logits_head = self.lm_head.kernel

    def set_enforce_eager(self, eager: bool) -> None:
        """--enforce-eager: every step through the Python layers, none through the native decoder stack."""
        if eager:
            self.model.native_stack = None
        elif self.model.native_stack is None:
            self.model.native_stack = NativeDecoderStack(self.model)

    def attach_quant_method(self, method) -> None:
        """Every linear layer takes `method`; the lm head takes the method's choice for heads."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.quant_method, module.layer_name = method, name
        self.lm_head_method = method.lm_head()
        if not self.tied and self.lm_head is not None:
            self.lm_head.quant_method = self.lm_head_method

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, md, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model's dtype: the sampler makes fp32 only when it needs more than an argmax. Under
        tensor parallel each rank computes its vocabulary slice and the first rank gets them all (None
        elsewhere): every rank of the last stage must call it."""
        return tp_gather(self.logits_head(hidden), self.config.vocab_size)

    def attention_layers(self) -> list[PagedAttention]:
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from tokenmill.model.moe import route_expert_weights

        weights = ((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights if self._owns(n))
        params = dict(self.named_parameters())
        stacked_experts = frozenset(n for n in params if ".mlp.experts." in n)   # they check their own loading
        load_stacked_weights(params, route_expert_weights(self, weights), optional=stacked_experts)

    def _owns(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this rank's pipeline stage."""
        m = _LAYER.match(name)
        if m:
            return int(m.group(1)) in self.model.stage
        if name.startswith("lm_head."):
            return self.last_stage and not self.tied
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.last_stage
        return True


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def load_stacked_weights(params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
                         optional: frozenset[str] = frozenset()) -> None:
    """Checkpoint tensors into parameters through their weight_loader: q/k/v and gate/up go into the fused
    projections as shards. Every parameter but the `optional` ones must be found."""
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        shard = None
        for sub, (fused, idx) in _STACKED.items():
            if f".{sub}." in name:
                name, shard = name.replace(f".{sub}.", f".{fused}."), idx
                break
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        param = params[name]
        if isinstance(tensor, torch.Tensor):  # (a QuantizedWeight goes to the layer as it is)
            tensor = tensor.to(param.dtype)
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        loaded.add(name)
    missing = sorted(set(params) - loaded - optional)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
