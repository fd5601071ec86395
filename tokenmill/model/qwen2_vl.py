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
from tokenmill.layers.linear import RMSNorm
from tokenmill.layers.rotary import inverse_frequencies, rope_parameters, rotate_half
from tokenmill.model.clip_vision import activation
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.model_config import head_dim_of
from tokenmill.multimodal.mrope import MRopeRows


class VisionBlock(nn.Module):
    """Qwen2-VL's block (LayerNorm, an fc1/fc2 MLP), or Qwen2.5-VL's (RMSNorm, a gated MLP with biases)."""

    def __init__(self, vc, v25: bool):
        super().__init__()
        d = vc.hidden_size if v25 else vc.embed_dim
        self.heads, self.v25 = vc.num_heads, v25
        norm = (lambda n: RMSNorm(n, 1e-6)) if v25 else (lambda n: nn.LayerNorm(n, eps=1e-6))
        self.norm1, self.norm2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.act = activation(vc.hidden_act)
        if v25:
            inter = vc.intermediate_size
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, inter), nn.Linear(d, inter), nn.Linear(inter, d)
        else:
            hidden = int(d * vc.mlp_ratio)
            self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]) -> torch.Tensor:
        """Attention within each of the consecutive `spans` of rows (a frame, or a window)."""
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, d // self.heads).unbind(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(v.dtype).transpose(0, 1)
        k = (kf * cos + rotate_half(kf) * sin).to(v.dtype).transpose(0, 1)
        v = v.transpose(0, 1)
        out = torch.cat([F.scaled_dot_product_attention(a, b, c) for a, b, c in
                         zip(q.split(spans, 1), k.split(spans, 1), v.split(spans, 1))], dim=1)
        x = x + self.proj(out.transpose(0, 1).reshape(n, d))
        h = self.norm2(x)
        if self.v25:
            return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        return x + self.fc2(self.act(self.fc1(h)))


def _windows(h: int, w: int, size: int) -> tuple[list[int], list[int]]:
    """Qwen2.5-VL's windows over an image's merged grid: tiles of size x size units in row order, units in row
    order within a tile. The units' order, and each window's unit count."""
    order, counts = [], []
    for top in range(0, h, size):
        for left in range(0, w, size):
            units = [r * w + c for r in range(top, min(top + size, h)) for c in range(left, min(left + size, w))]
            order += units
            counts.append(len(units))
    return order, counts


class Qwen2VisionTower(nn.Module):
    def __init__(self, vc, v25: bool = False):
        super().__init__()
        self.merge, self.v25 = vc.spatial_merge_size, v25
        width = vc.hidden_size if v25 else vc.embed_dim
        out = vc.out_hidden_size if v25 else vc.hidden_size
        self.full_blocks = set(getattr(vc, "fullatt_block_indexes", None) or ()) if v25 else None
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size if v25 else 0
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = nn.Linear(self.patch_dim, width, bias=False)   # the checkpoint's Conv3d, flat
        head = width // vc.num_heads
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head // 2   # half the head's frequencies for rows, half for columns
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial),
                             persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(vc, v25) for _ in range(vc.depth))
        self.ln_q = RMSNorm(width, 1e-6) if v25 else nn.LayerNorm(width, eps=1e-6)
        merged = width * self.merge ** 2
        self.mlp0, self.mlp2 = nn.Linear(merged, merged), nn.Linear(merged, out)

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
        unit = self.merge ** 2
        frame = [h * w] * t   # full attention within each frame (an image has one)
        if self.v25:   # rows regrouped window by window (units of merge x merge patches move together)
            order, counts = _windows(h // self.merge, w // self.merge, self.window)
            index = torch.tensor([u + f * len(order) for f in range(t) for u in order])
            x, cos, sin = (a.view(-1, unit, *a.shape[1:])[index].flatten(0, 1) for a in (x, cos, sin))
            windows = [c * unit for _ in range(t) for c in counts]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame if not self.v25 or i in self.full_blocks else windows)
        out = self.mlp2(F.gelu(self.mlp0(self.ln_q(x).view(-1, self.mlp0.in_features))))
        return out[torch.argsort(index)] if self.v25 else out

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        name = {"merger.ln_q.weight": "ln_q.weight", "merger.ln_q.bias": "ln_q.bias",
                "merger.mlp.0.weight": "mlp0.weight", "merger.mlp.0.bias": "mlp0.bias",
                "merger.mlp.2.weight": "mlp2.weight", "merger.mlp.2.bias": "mlp2.bias",
                "patch_embed.proj.weight": "patch_embed.weight"}.get(name, name)
        name = name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.")
        for sub in ("fc1", "fc2", "gate_proj", "up_proj", "down_proj"):
            name = name.replace(f".mlp.{sub}.", f".{sub}.")
        if "_params" not in self.__dict__:   # (looked up once, not once a tensor)
            self.__dict__["_params"] = dict(self.named_parameters())
        params = self.__dict__["_params"]
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
        self.visual = Qwen2VisionTower(cfg.vision_config, v25=cfg.model_type == "qwen2_5_vl")
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
