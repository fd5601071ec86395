"""LLaVA (LlavaForConditionalGeneration, the LLaVA-1.5 layout): a CLIP vision tower, a two-layer projector, and
a Llama-family language model, which is this class's base: everything the engine runs per token is that model's.
What LLaVA adds is embed_multimodal (images -> one embedding per placeholder token), which the runner's encoder
stage calls, and the placeholders' rows of inputs_embeds, which the runner fills with them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.model.clip_vision import CLIPVisionTower, activation
from tokenmill.model.llama import LlamaForCausalLM


class LlavaProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _renamed(name: str) -> str:
    """Both checkpoint layouts onto one: transformers 5's (model.language_model.*, model.vision_tower.*, lm_head)
    and the original llava-hf one (language_model.model.*, language_model.lm_head, vision_tower.vision_model.*)."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_positions: int):
        super().__init__(cfg.text_config, backend, max_positions)
        vc = cfg.vision_config
        layers = cfg.vision_feature_layer
        layers = list(layers) if isinstance(layers, (list, tuple)) else [int(layers)]
        self.vision_tower = CLIPVisionTower(vc, layers)
        self.multi_modal_projector = LlavaProjector(vc.hidden_size * len(layers), cfg.text_config.hidden_size,
                                                    cfg.projector_hidden_act,
                                                    bool(getattr(cfg, "multimodal_projector_bias", True)))
        self.keep_class_token = getattr(cfg, "vision_feature_select_strategy", "default") == "full"

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden] in the language model's dtype (images of one size: one batch)."""
        pixels = torch.stack([item["pixel_values"] for item in items])
        features = self.vision_tower(pixels)
        if not self.keep_class_token:
            features = features[:, 1:]
        out = self.multi_modal_projector(features).to(self.model.embed_tokens.weight.dtype)
        return list(out.unbind(0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def language_model_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters()
                if not n.startswith(("vision_tower.", "multi_modal_projector."))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._vision_split(weights))

    def _vision_split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the tower's and projector's tensors as they stream past; yields the language model's."""
        projector = dict(self.multi_modal_projector.named_parameters())
        seen, tower_seen = set(), set()
        for name, tensor in weights:
            name = _renamed(name)
            if name.startswith("vision_tower."):
                tower_seen.add(self.vision_tower.load_weight(name[len("vision_tower."):], tensor))
            elif name.startswith("multi_modal_projector."):
                sub = name[len("multi_modal_projector."):]
                if sub not in projector:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                projector[sub].data.copy_(tensor)
                seen.add(sub)
            else:
                yield name, tensor
        missing = [f"multi_modal_projector.{n}" for n in sorted(set(projector) - seen)] + \
            [f"vision_tower.{n}" for n, _ in self.vision_tower.named_parameters() if n not in tower_seen]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
