"""EAGLE draft heads (versions 1 and 3) for a Llama-family target, from the published checkpoint layouts.

The head is one (or a few) Llama decoder layers fed with a token's embedding and the target's hidden state at
the position before it: `fc(cat(embed(t[i+1]), f[i]))`, where `f[i]` is the target's final (normed) hidden
state that predicted `t[i+1]`. Its output is a guess of `f[i+1]`, which the target's own lm head turns into a
draft of `t[i+2]` and which feeds the next pass. The first layer has no input norm and the head no final norm,
as in the EAGLE checkpoints (`fc.weight`, optional `fc.bias`, `layers.N.*`, an optional `embed_tokens.weight`;
a "model." prefix is tolerated). Without its own embedding the head reads the target's.

EAGLE-3 instead reads three of the target's intermediate residual streams (layers 2, L/2 and L-3 unless its
config's `eagle_config.eagle_aux_hidden_state_layer_ids` says otherwise), joined by `fc` (3h -> h); its one layer
(`midlayer.*`) normalizes the embedding and the hidden state separately (`input_layernorm`, `hidden_norm`) and
attends over both side by side (q/k/v read 2h); a final `norm` and its own `lm_head` over a draft vocabulary give
the draft, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]). The pre-norm output feeds the
next pass.

Both heads offer the same calls: `features(target_hidden, aux)` for the mirror, `forward(...)` -> (the states to
draft from, the feature of the next pass), and `draft(states)` -> token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.linear import Embedding, Linear, MergedLinear, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.layers.sampler import greedy_tokens
from tokenmill.model.llama import load_stacked_weights
from tokenmill.model.llama_layers import LlamaDecoderLayer
from tokenmill.model.model_config import head_dim_of


class _NoNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Head(nn.Module):
    """What both heads share: their attention layers (for the KV cache) and the kernels made after loading."""

    layers: nn.ModuleList

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def process_weights_after_loading(self) -> None:
        for module in reversed(list(self.modules())):
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


class EagleHead(_Head):
    aux_layers: tuple[int, ...] = ()   # EAGLE-1 reads only the target's final hidden states

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, fc_bias: bool, target_logits=None):
        super().__init__()
        # the target's lm head (EAGLE-1 has none of its own): kept out of the head's modules and parameters
        object.__setattr__(self, "target_logits", target_logits)
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg))
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, self.rotary, 0)
                                    for _ in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = _NoNorm()

    def features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        out = x + residual
        return out, out

    def draft(self, states: torch.Tensor) -> torch.Tensor:
        return greedy_tokens(self.target_logits(states))


    def load_weights(self, weights, target_embedding: torch.Tensor) -> None:
        weights = [(n.removeprefix("model."), t) for n, t in weights if not n.startswith("lm_head.")]
        if not any(n == "embed_tokens.weight" for n, _ in weights):
            weights.append(("embed_tokens.weight", target_embedding))
        load_stacked_weights(dict(self.named_parameters()), weights)



class Eagle3Head(_Head):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, target_cfg):
        super().__init__()
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.aux_layers = eagle3_aux_layers(cfg, target_cfg.num_hidden_layers)
        self.embed_tokens = Embedding(cfg.vocab_size, h)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg))
        target_h = int(getattr(cfg, "target_hidden_size", None) or target_cfg.hidden_size)
        self.fc = Linear(len(self.aux_layers) * target_h, h)
        layer = LlamaDecoderLayer(cfg, backend, self.rotary, 0)
        attn = layer.self_attn
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attn.qkv_proj = MergedLinear(2 * h, [q, kv, kv], bias=bool(getattr(cfg, "attention_bias", False)))
        layer.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, eps)
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.lm_head = Linear(h, self.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)

    def features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([aux[i] for i in self.aux_layers], dim=-1))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        emb = self.embed_tokens(input_ids)
        residual = features.to(emb.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(residual)], dim=-1)
        x = layer.self_attn(positions, x, md)
        x, residual = layer.post_attention_layernorm(x, residual)
        return self.norm(layer.mlp(x), residual)   # (normed: to draft from, pre-norm: the next feature)

    def draft(self, states: torch.Tensor) -> torch.Tensor:
        ids = greedy_tokens(self.lm_head(states))
        return ids + self.d2t[ids]


    def load_weights(self, weights, target_embedding: torch.Tensor) -> None:
        renamed = []
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "d2t":
                if tensor.numel() != self.draft_vocab_size:
                    raise ValueError(f"d2t has {tensor.numel()} entries for a draft vocabulary of "
                                     f"{self.draft_vocab_size}")
                self.d2t.copy_(tensor.long())
            elif name != "t2d":
                renamed.append((name, tensor))
        if not any(n == "embed_tokens.weight" for n, _ in renamed):
            renamed.append(("embed_tokens.weight", target_embedding))
        load_stacked_weights(dict(self.named_parameters()), renamed)



def eagle3_aux_layers(cfg, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming residual stream an EAGLE-3 head reads (vLLM's defaults)."""
    eagle_cfg = getattr(cfg, "eagle_config", None) or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    layers = tuple(int(i) for i in ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise ValueError(f"the EAGLE-3 head reads target layers {layers}; a {num_target_layers}-layer target "
                         f"needs three ids below {num_target_layers} (eagle_config.eagle_aux_hidden_state_layer_ids)")
    for key in ("norm_before_fc", "norm_before_residual"):
        if getattr(cfg, key, False) or (isinstance(eagle_cfg, dict) and eagle_cfg.get(key)):
            raise ValueError(f"EAGLE-3 heads with {key} are not supported")
    return layers


def eagle_checkpoint_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors files, else the pytorch_model.bin most EAGLE heads ship (read with weights_only: no code runs)."""
    from tokenmill.model.loader import iter_safetensors

    path = Path(folder)
    if any(path.glob("*.safetensors")):
        yield from iter_safetensors(folder)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"speculative_config.model: no .safetensors or pytorch_model.bin in {folder}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()

