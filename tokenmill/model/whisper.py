"""Whisper (WhisperForConditionalGeneration): an audio encoder over 30 s of log-mel frames, and a text decoder
whose layers attend their own tokens (self-attention, K/V in the paged cache) and the encoder's output
(cross-attention).

The cross-attention K/V of every decoder layer are computed once per request, when its encoder runs, into a
slot of the model's second cache group (`cross_attention_layers()`, bound by the runner): each running request
holds one slot, `md.cross_slots` names it per step. The encoder is plain torch (it runs once per 30 s of audio);
the decoder's matmuls are the engine's linear layers, so they take its kernels and quant methods.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.encoder_attention import EncoderSelfAttention
from tokenmill.layers.linear import Embedding, Linear, MergedLinear
from tokenmill.layers.quant import UnquantizedMethod


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = EncoderSelfAttention(d, cfg.encoder_attention_heads, key_bias=False)
        self.fc1, self.fc2 = nn.Linear(d, cfg.encoder_ffn_dim), nn.Linear(cfg.encoder_ffn_dim, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        self.num_frames = 2 * cfg.max_source_positions   # the mel frames of one 30 s window

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, mel bins, 3000] -> [B, 1500, d]."""
        if features.shape[-1] != self.num_frames:
            raise ValueError(f"Whisper's encoder takes {self.num_frames} mel frames (30 s), got {features.shape[-1]}")
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, backend: AttentionBackend):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.qkv_proj = MergedLinear(d, [d, d, d], bias=True)   # the k shard's bias stays zero
        self.out_proj = Linear(d, d, bias=True)
        self.attn = PagedAttention(heads, heads, self.head_dim, backend)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.reshape(-1, self.heads, self.head_dim).contiguous()
                   for t in self.qkv_proj.split(self.qkv_proj(x)))
        return self.out_proj(self.attn(q, k, v, md).reshape(x.shape[0], -1))


class CrossAttention(nn.Module):
    """Each request's query tokens attend the encoder output of its own slot in `cache`, [2, slots, heads,
    positions, head_dim], written once by `write_kv` when the request's encoder runs."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = Linear(d, d, bias=True)
        self.kv_proj = MergedLinear(d, [d, d], bias=True)   # on the encoder output; the k shard's bias stays zero
        self.out_proj = Linear(d, d, bias=True)
        self.cache: torch.Tensor | None = None

    def write_kv(self, encoded: torch.Tensor, slots: list[int]) -> None:
        b, n, _ = encoded.shape
        k, v = self.kv_proj.split(self.kv_proj(encoded.reshape(b * n, -1)))
        idx = torch.tensor(slots, device=encoded.device)
        self.cache[0, idx] = k.reshape(b, n, self.heads, self.head_dim).transpose(1, 2).to(self.cache.dtype)
        self.cache[1, idx] = v.reshape(b, n, self.heads, self.head_dim).transpose(1, 2).to(self.cache.dtype)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.heads, self.head_dim)
        qsl = md.query_start_loc_np
        out = torch.empty_like(q)
        for i, slot in enumerate(md.cross_slots):   # (one slot a request: nothing to pad or mask)
            a, b = int(qsl[i]), int(qsl[i + 1])
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), self.cache[0, slot], self.cache[1, slot])
            out[a:b] = o.transpose(0, 1)
        return self.out_proj(out.reshape(x.shape[0], -1))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        d = cfg.d_model
        self.self_attn_layer_norm, self.encoder_attn_layer_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.self_attn = DecoderSelfAttention(d, cfg.decoder_attention_heads, backend)
        self.encoder_attn = CrossAttention(d, cfg.decoder_attention_heads)
        self.fc1, self.fc2 = Linear(d, cfg.decoder_ffn_dim, bias=True), Linear(cfg.decoder_ffn_dim, d, bias=True)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), md)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), md)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, backend) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x, md)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg, backend)


# checkpoint sub-name -> (fused parameter sub-name, shard)
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
          "self_attn.v_proj": ("self_attn.qkv_proj", 2), "encoder_attn.k_proj": ("encoder_attn.kv_proj", 0),
          "encoder_attn.v_proj": ("encoder_attn.kv_proj", 1)}
_DECODER_LAYER = re.compile(r"(model\.decoder\.layers\.\d+\.)(self_attn\.[qkv]_proj|encoder_attn\.[kv]_proj)\.(.*)")


class WhisperForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = WhisperModel(cfg, backend)
        self.lm_head_method = UnquantizedMethod()
        self.logits_head = None
        self.tied = True   # Whisper's output projection is its token embedding
        for module in self.modules():   # the fused projections' key shards have no bias in the checkpoint
            if isinstance(module, MergedLinear):
                module.bias.data.zero_()

    # ---- what the runner calls -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                intermediate=None) -> torch.Tensor:
        if md.cross_slots is None:
            raise RuntimeError("a Whisper step needs each request's cross-attention slot (md.cross_slots)")
        return self.model.decoder(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_head(hidden)

    def encode(self, features: torch.Tensor, slots: list[int]) -> None:
        """Runs the encoder on [B, mel bins, frames] and writes each decoder layer's cross-attention K/V of the
        output into `slots`."""
        encoded = self.model.encoder(features.to(self.model.encoder.conv1.weight.dtype))
        for layer in self.model.decoder.layers:
            layer.encoder_attn.write_kv(encoded, slots)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def cross_attention_layers(self) -> list[CrossAttention]:
        return [layer.encoder_attn for layer in self.model.decoder.layers]

    # ---- loading -------------------------------------------------------------------------------
    def attach_quant_method(self, method) -> None:
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.quant_method, module.layer_name = method, name
        self.lm_head_method = method.lm_head()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "proj_out.weight":
                continue   # (tied: the token embedding)
            shard = None
            m = _DECODER_LAYER.match(name)
            if m:
                fused, shard = _FUSED[m.group(2)]
                name = f"{m.group(1)}{fused}.{m.group(3)}"
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching Whisper parameter")
            param = params[name]
            tensor = tensor.to(param.dtype)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing Whisper weights: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        embed = self.model.decoder.embed_tokens
        self.logits_head = self.lm_head_method.make_kernel("lm_head", embed.weight, None, None)
