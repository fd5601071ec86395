"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (RMSNorm on q and k), and their
mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (the MLP is then `model/moe.py`'s).

Differences are config fields, not subclasses; a decoder layer is `model/llama_layers.py`'s. q/k/v and gate/up
are fused into single matmuls at load.
Tensor parallel: q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (one all-reduce
each), the embedding and lm head split the vocabulary. Pipeline parallel: a rank builds only its stage's layers;
the first stage embeds, the last one norms and computes logits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import ParallelConfig
from tokenmill.distributed.comm import tp_gather
from tokenmill.distributed.parallel_state import get_pp
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.linear import Embedding, Linear, RMSNorm
from tokenmill.layers.quant import UnquantizedMethod
from tokenmill.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.model.llama_layers import LlamaDecoderLayer
from tokenmill.model.model_config import head_dim_of
from tokenmill.model.moe import route_expert_weights
from tokenmill.model.native_stack import NativeDecoderStack

# checkpoint sub-name -> (fused parameter sub-name, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """Hidden states after the final norm; on a pipeline stage before the last, the (x, residual) pair that
        the next stage continues from (`intermediate` is what a later stage received). `inputs_embeds` replaces
        the embedding of input_ids (a vision model's image embeddings are in it)."""
        self.rotary.new_step()
        if intermediate is None and self.native_stack is not None:
            out = (self.native_stack.forward(input_ids, positions, md) if inputs_embeds is None else
                   self.native_stack.forward(input_ids, positions, md, inputs_embeds=inputs_embeds))
            if out is not None:   # (a step with auxiliary hidden states to keep never gets here)
                self.aux_hidden_states = {}
                return out
        if intermediate is not None:
            x, residual = intermediate
        else:
            x, residual = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds), None
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
        self.logits_head = self._make_logits_head()

    def _make_logits_head(self):
        """The kernel compute_logits runs, once the layers hold their loaded weights."""
        if not self.last_stage:
            return None
        if self.tied:  # the head gets its own copy of the embedding, packed or quantized
            head = self.lm_head_method.make_kernel("lm_head", self.lm_head.weight, None, self.lm_head.quantized)
            self.lm_head.quantized = None
            return head
        return self.lm_head.kernel

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
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None):
        return self.model(input_ids, positions, md, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model's dtype: the sampler makes fp32 only when it needs more than an argmax. Under
        tensor parallel each rank computes its vocabulary slice and the first rank gets them all (None
        elsewhere): every rank of the last stage must call it."""
        return tp_gather(self.logits_head(hidden), self.config.vocab_size)

    def attention_layers(self) -> list[PagedAttention]:
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = ((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights if self._owns(n))
        params = self.language_model_parameters()
        stacked_experts = frozenset(n for n in params if ".mlp.experts." in n)   # they check their own loading
        load_stacked_weights(params, route_expert_weights(self, weights), optional=stacked_experts)

    def language_model_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters load_weights fills from the checkpoint's language-model tensors (a vision model's
        own parts are loaded apart)."""
        return dict(self.named_parameters())

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
