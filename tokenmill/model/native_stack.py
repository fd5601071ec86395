"""A Llama-family decoder's layers as one native call (kernels/csrc/decoder_stack.cpp).

Eager Python spends ~6 ms of each batch-1 step of the embedded model between kernels (30 layers, ~40 torch
calls each); the native loop calls the same kernels in the same order, so its output is the Python path's bit for
bit. It takes decode steps of any batch and prompts (on the native prompt kernel: bf16, head_dim 64), where the
cache holds bf16 also prompt chunks after cached context and requests that share a cached prefix (attended once
for all of them, as the backend's cascade); a bf16 linear takes any batch (past its tile kernels, oneDNN's
matmul, as in Python). The Python path stays the reference that every other case takes: attention through SDPA,
batches past a quantized linear's kernels, LoRA, tensor or pipeline parallel, EAGLE's auxiliary hidden states,
sliding windows, KV scales still to calibrate, the torch kernels. It is the CPU's counterpart of a captured CUDA
graph; `--enforce-eager` turns it off, as it turns graphs off in vLLM.
"""

from __future__ import annotations

import weakref

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kernels import ANY_ROWS
from tokenmill.platform import device_type
from tokenmill.utils import init_logger

logger = init_logger(__name__)

_TILES, _QUANTIZED = 0, 1


def _kernel_namespace() -> str | None:
    """The op namespace of the selected kernel set, None where it has none (asked when a model is built)."""
    import tokenmill.kernels as kernels

    return kernels.active().namespace if kernels.ops() is not None else None


def _stack_class(namespace: str | None):
    if namespace is None:
        return None
    try:
        return getattr(torch.classes, namespace).DecoderStack
    except (AttributeError, RuntimeError):   # built without AVX-512 BF16 or the portable kernels
        return None


def _linear_spec(linear) -> tuple | None:
    """The native loop's description of one linear layer, with the most rows it takes; None where it cannot."""
    from tokenmill.layers.packed_weight import PackedWeight
    from tokenmill.layers.quant.kernel import QuantLinearKernel

    if linear.lora is not None or linear.parallel is not None:
        return None
    k = linear.kernel
    if isinstance(k, PackedWeight) and k.tiles is not None:   # past its tile path, oneDNN: any number of rows
        return (_TILES, k.tiles, None, None, k.bias, k.out_features, k.skinny_max_rows, k.tile_max_rows, 0, 0,
                k.gated_on_tiles, k.packed), ANY_ROWS if k.packed is not None else k.tile_max_rows
                # past its tile kernels (on AMX) oneDNN, where the CPU runs oneDNN's bf16
    if isinstance(k, QuantLinearKernel) and k.native:   # (native: the VNNI kernel was built)
        return (_QUANTIZED, k.q, k.scale, k.min, k.bias_f32, k.out_features, k.vnni_max_rows, k.max_rows, k.bits,
                k.group, k.gated_on_tiles, None), k.max_rows
    return None


def _layer_fits(layer) -> bool:
    """A decoder layer whose Python path the native loop mirrors: the fused rope-and-cache attention on the CPU
    backend with full attention, a dense SiLU MLP, the native norms."""
    from tokenmill.attention.cpu import CpuPagedBackend
    from tokenmill.model.llama_layers import LlamaDecoderLayer
    from tokenmill.model.llama_mlp import LlamaMLP

    if not isinstance(layer, LlamaDecoderLayer):
        return False
    a = layer.self_attn
    return (a.native and a.attn.sliding_window == 0 and isinstance(a.attn.backend, CpuPagedBackend)
            and isinstance(layer.mlp, LlamaMLP) and layer.mlp.native
            and layer.input_layernorm.native and layer.post_attention_layernorm.native)


class NativeDecoderStack:
    """Built once the KV caches are bound (lazily, at the first step); `forward` answers None for a step it
    does not take, and the caller runs the Python layers."""

    def __init__(self, model):
        self.model = weakref.proxy(model)   # the LlamaModel, which holds this (no cycle to keep it alive)
        self.stack = None
        self.max_rows = 0
        self.cache = None           # the first layer's KV cache the stack was built with (rebound: rebuilt)
        self.unavailable = False    # some layer can never take the native loop: stop asking
        # the kernels of the engine that builds this model (a later engine in the process may select others)
        self.namespace = _kernel_namespace() if device_type() == "cpu" else None

    def _build(self) -> None:
        m = self.model
        layers = [m.layers[i] for i in m.stage]
        # (the layers first: on a GPU they never fit, and asking for the class would build the CPU kernels)
        if m.norm is None or not m.norm.native or not layers or len(layers) != len(m.layers) \
                or not all(_layer_fits(layer) for layer in layers) or (cls := _stack_class(self.namespace)) is None:
            self.unavailable = True
            return
        attns = [layer.self_attn for layer in layers]
        if any(a.attn.kv_cache is None or a.attn.calibrate for a in attns):
            return   # not yet: try again at the next step
        first = attns[0]
        specs = []
        for layer in layers:
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            layer_specs = [_linear_spec(lin) for lin in linears]
            if any(s is None for s in layer_specs):
                self.unavailable = True
                return
            specs.append(layer_specs)
        stack = cls(first.num_heads, first.num_kv_heads, first.head_dim, float(m.norm.eps), float(first.attn.scale),
                    m.rotary.cos, m.rotary.sin, m.norm.weight.detach())
        for layer, layer_specs in zip(layers, specs):
            a = layer.self_attn.attn
            stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                            a.kv_cache[0], a.kv_cache[1], float(a.k_scale), float(a.v_scale), a.k_offset)
            for spec, _ in layer_specs:
                stack.add_linear(*spec)
        self.stack = stack
        self.max_rows = min(rows for layer_specs in specs for _, rows in layer_specs)
        self.cache = first.attn.kv_cache
        self.backend = first.attn.backend
        bf16 = m.embed_tokens.weight.dtype == torch.bfloat16
        # prompt chunks and shared-prefix steps too (on the prompt kernel, as the backend runs them); those that
        # read keys from the cache (a shared prefix, a chunk after cached context) on a bf16 cache only
        self.prompts = bf16 and self.backend.native_prompts(first.head_dim)
        self.cached_keys = bf16 and self.backend.native_cached_keys(self.cache, first.head_dim)
        size = "of any size" if self.max_rows >= ANY_ROWS else f"of up to {self.max_rows} tokens"
        what = "decode, prompt and shared-prefix" if self.cached_keys else "decode and prompt" if self.prompts \
            else "decode"
        logger.info("%s steps %s run the %d layers as one native call", what, size, len(layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm's output for this step (only md.output_rows' rows where set), or None where the Python
        layers must run it. `inputs_embeds`, where given, replaces the embedding of input_ids (a vision model's
        step with image embeddings in it)."""
        m = self.model
        if self.unavailable or input_ids.dim() != 1 or m.aux_hidden_state_layers:
            return None
        if self.stack is None or m.layers[m.stage[0]].self_attn.attn.kv_cache is not self.cache:
            self.stack = None
            self._build()
            if self.stack is None:
                return None
        if input_ids.shape[0] > self.max_rows:
            return None
        plan = self.backend.native_plan(md, self.cache.shape[2], self.prompts, self.cached_keys)
        if plan is None:
            return None
        p = plan.prefix
        prefix = (0, -1, None, None, False) if p is None else (
            p.num_blocks, -1 if p.first_block is None else p.first_block, p.block_ids, p.token_index, p.all_tokens)
        x = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.stack.forward(x, positions, md.slot_mapping, md.block_table,
                                  md.seq_lens, md.query_start_loc, plan.kernel_rows, bool(self.backend.decode_amx),
                                  *prefix, plan.prompt_spans, md.output_rows)
