"""Qwen2-VL (Qwen2VLForConditionalGeneration): a ViT over 14-pixel patches of the image at its own resolution
(2-D rotary positions, full attention within each image), a merger of 2x2 patches into one embedding, and the
Qwen2 language model, which is this class's base. The language model's rotary positions are M-RoPE's three
sections; multimodal/mrope.py gives each prompt token its (t, h, w) and the rotary table rows they need."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.layers.rotary import inverse_frequencies, rope_parameters
from tokenmill.model.clip_vision import activation
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.model_config import head_dim_of
from tokenmill.multimodal.mrope import MRopeRows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, vc):
        super().__init__()
        d = vc.embed_dim
        self.heads = vc.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        hidden = int(d * vc.mlp_ratio)
        self.fc1, self.fc2, self.act = nn.Linear(d, hidden), nn.Linear(hidden, d), activation(vc.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, d // self.heads).unbind(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(v.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.proj(out.transpose(0, 1).reshape(n, d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Qwen2VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = nn.Linear(self.patch_dim, vc.embed_dim, bias=False)   # the checkpoint's Conv3d, flat
        head = vc.embed_dim // vc.num_heads
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head // 2   # half the head's frequencies for rows, half for columns
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial),
                             persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        width = vc.embed_dim * self.merge ** 2
        self.ln_q = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.mlp0, self.mlp2 = nn.Linear(width, width), nn.Linear(width, vc.hidden_size)

    def _rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) angles, patches ordered in merge x merge blocks as the processor lays them."""
        m = self.merge
        hp = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        wp = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        freqs = torch.cat([hp[:, None] * self.inv_freq, wp[:, None] * self.inv_freq], dim=-1).repeat(t, 1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, patch_dim] -> its embeddings [t*h*w / merge^2, hidden]."""
        t, h, w = grid
        cos, sin = self._rotary(t, h, w)
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        frames = x.view(t, h * w, -1)   # attention within each frame (an image has one)
        x = torch.cat([self._frame(f, cos[: h * w], sin[: h * w]) for f in frames])
        return self.mlp2(F.gelu(self.mlp0(self.ln_q(x).view(-1, self.mlp0.in_features))))

    def _frame(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        name = {"merger.ln_q.weight": "ln_q.weight", "merger.ln_q.bias": "ln_q.bias",
                "merger.mlp.0.weight": "mlp0.weight", "merger.mlp.0.bias": "mlp0.bias",
                "merger.mlp.2.weight": "mlp2.weight", "merger.mlp.2.bias": "mlp2.bias",
                "patch_embed.proj.weight": "patch_embed.weight"}.get(name, name)
        name = name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.")
        name = name.replace(".mlp.fc1.", ".fc1.").replace(".mlp.fc2.", ".fc2.")
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"checkpoint tensor visual.{name} has no matching parameter")
        params[name].data.copy_(tensor.reshape(params[name].shape))
        return name


def _renamed(name: str) -> str:
    """transformers 5's layout (model.language_model.*, model.visual.*) and the original one (model.*, visual.*)."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int):
        super().__init__(cfg.text_config, backend, max_positions)
        self.visual = Qwen2VisionTower(cfg.vision_config)
        rope = dict(getattr(cfg.text_config, "rope_parameters", None) or getattr(cfg.text_config, "rope_scaling", {}))
        self.spatial_merge_size = cfg.vision_config.spatial_merge_size
        text = cfg.text_config
        self.mrope = MRopeRows(self.model.rotary, inverse_frequencies(head_dim_of(text), rope_parameters(text)),
                               list(rope.get("mrope_section") or [16, 24, 24]), max(max_positions, 16384))

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        dtype = self.model.embed_tokens.weight.dtype
        return [self.visual(item["pixel_values"], tuple(int(g) for g in item["image_grid_thw"].reshape(-1)))
                .to(dtype) for item in items]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def language_model_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith("visual.")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._vision_split(weights))

    def _vision_split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        seen = set()
        for name, tensor in weights:
            name = _renamed(name)
            if name.startswith("visual."):
                seen.add(self.visual.load_weight(name[len("visual."):], tensor))
            else:
                yield name, tensor
        missing = [n for n, _ in self.visual.named_parameters() if n not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join('visual.' + n for n in missing[:5])}")
