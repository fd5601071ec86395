"""An EAGLE (version 1) draft head for a Llama-family target, from the published checkpoint layout.

The head is one (or a few) Llama decoder layers fed with a token's embedding and the target's hidden state at
the position before it: `fc(cat(embed(t[i+1]), f[i]))`, where `f[i]` is the target's final (normed) hidden
state that predicted `t[i+1]`. Its output is a guess of `f[i+1]`, which the target's own lm head turns into a
draft of `t[i+2]` and which feeds the next pass. The first layer has no input norm and the head no final norm,
as in the EAGLE checkpoints (`fc.weight`, optional `fc.bias`, `layers.N.*`, an optional `embed_tokens.weight`;
a "model." prefix is tolerated). Without its own embedding the head reads the target's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.model.llama import LlamaDecoderLayer, head_dim_of, load_stacked_weights


class _NoNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, fc_bias: bool):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg))
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, self.rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = _NoNorm()

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        emb = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        return x + residual

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights, target_embedding: torch.Tensor) -> None:
        weights = [(n.removeprefix("model."), t) for n, t in weights if not n.startswith("lm_head.")]
        if not any(n == "embed_tokens.weight" for n, _ in weights):
            weights.append(("embed_tokens.weight", target_embedding))
        load_stacked_weights(dict(self.named_parameters()), weights)

    def process_weights_after_loading(self) -> None:
        for module in reversed(list(self.modules())):
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


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

