"""CLIP's vision transformer (LLaVA's tower): patches, a class token and learned positions, then pre-norm
encoder layers with full (bidirectional) attention. Only the layers up to the one whose output the model reads
are built. Plain torch modules: an image is encoded once, so these layers are not on the per-token path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.encoder_attention import EncoderSelfAttention

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r} in the vision config")
    return _ACTS[name]


class CLIPMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(hidden, inter), nn.Linear(inter, hidden), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = EncoderSelfAttention(vc.hidden_size, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = CLIPMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, vc.patch_size, vc.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(vc.hidden_size))
        self.num_positions = (vc.image_size // vc.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] + 1 != self.num_positions:
            raise ValueError(f"the image makes {patches.shape[1]} patches; the tower's positions take "
                             f"{self.num_positions - 1}")
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(nn.Module):
    """Hidden states of the layers `feature_layers` names (HF's hidden_states indices: 0 is the embeddings after
    the pre-norm, i the output of layer i; negative from the end), concatenated on the last dimension."""

    def __init__(self, vc, feature_layers: list[int]):
        super().__init__()
        total = vc.num_hidden_layers
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in feature_layers]
        if not all(0 <= i <= total for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {total} layers")
        self.embeddings = CLIPEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """One checkpoint tensor by its name under the tower (encoder.layers.i.* for the layers): the parameter
        it filled, or None for what the model never reads (post_layernorm, layers past the last one used)."""
        if name.startswith("encoder."):
            name = name[len("encoder."):]
            index = int(name.split(".")[1])
            if index >= len(self.layers):
                return None
        elif name.startswith("post_layernorm."):
            return None
        if "_params" not in self.__dict__:   # (looked up once, not once a tensor)
            self.__dict__["_params"] = dict(self.named_parameters())
        params = self.__dict__["_params"]
        if name not in params:
            raise ValueError(f"checkpoint tensor vision_tower.{name} has no matching parameter")
        params[name].data.copy_(tensor)
        return name
