"""Each vision family's preprocessing (its Hugging Face image processor, read from the model folder) and the
placeholder tokens its images take in a prompt: a prompt names an image with one placeholder token, which is
expanded here to as many as the image has embeddings, and the image becomes a MultiModalFeature over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenmill.multimodal.inputs import MultiModalFeature, TensorData, content_hash, media_items
from tokenmill.multimodal.media_io import MediaOptions, checked_image

DEFAULT_IMAGE_LIMIT = 8   # images per prompt unless --limit-mm-per-prompt says otherwise


class ImageInputs(Protocol):
    placeholder_id: int       # the token id that stands for an image in a prompt
    placeholder: str          # its text, as chat templates write it

    def preprocess(self, images: list) -> list[tuple[dict[str, np.ndarray], int]]:
        """Per image: the vision tower's inputs and how many embeddings (placeholder tokens) it makes."""


class LlavaImages:
    """LLaVA-1.5: CLIP's resize, centre crop and normalisation; one embedding per patch (and the class token's
    with vision_feature_select_strategy "full")."""

    def __init__(self, folder: str, hf_config, tokenizer, kwargs: dict):
        self.processor = _image_processor(folder, kwargs)
        self.placeholder_id = int(getattr(hf_config, "image_token_index", None) or hf_config.image_token_id)
        self.placeholder = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self.patch = int(hf_config.vision_config.patch_size)
        self.extra = 1 if getattr(hf_config, "vision_feature_select_strategy", "default") == "full" else 0

    def preprocess(self, images: list) -> list[tuple[dict[str, np.ndarray], int]]:
        pixels = np.asarray(self.processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
        h, w = pixels.shape[-2:]
        n = (h // self.patch) * (w // self.patch) + self.extra
        return [({"pixel_values": pixels[i]}, n) for i in range(len(images))]


    @staticmethod
    def max_tokens(hf_config, folder: str, kwargs: dict) -> int:
        vc = hf_config.vision_config   # the tower's position table fixes the image size
        extra = 1 if getattr(hf_config, "vision_feature_select_strategy", "default") == "full" else 0
        return (int(vc.image_size) // int(vc.patch_size)) ** 2 + extra


class Qwen2VLImages:
    """Qwen2-VL: the image at its own resolution, resized to multiples of 28 pixels within min_pixels..max_pixels
    (the processor's `size`), cut into 14-pixel patches; one embedding per 2x2 patches. The encoder inputs are
    the flat patches and the (t, h, w) grid, which M-RoPE's positions also read."""

    def __init__(self, folder: str, hf_config, tokenizer, kwargs: dict):
        self.processor = _image_processor(folder, kwargs)
        self.placeholder_id = int(hf_config.image_token_id)
        self.placeholder = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def preprocess(self, images: list) -> list[tuple[dict[str, np.ndarray], int]]:
        out = []
        for img in images:   # each its own size: one call an image
            enc = self.processor(images=[img], return_tensors="np")
            grid = np.asarray(enc["image_grid_thw"], dtype=np.int64).reshape(3)
            out.append(({"pixel_values": np.asarray(enc["pixel_values"], dtype=np.float32), "image_grid_thw": grid},
                        int(grid.prod()) // self.merge ** 2))
        return out

    @staticmethod
    def max_tokens(hf_config, folder: str, kwargs: dict) -> int:
        size = _image_processor(folder, kwargs).size
        max_pixels = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
        vc = hf_config.vision_config
        return int(max_pixels or 12845056) // (vc.patch_size * vc.spatial_merge_size) ** 2


_FAMILIES = {"llava": LlavaImages, "qwen2_vl": Qwen2VLImages, "qwen2_5_vl": Qwen2VLImages}


def max_tokens_per_image(hf_config, folder: str, kwargs: dict) -> int:
    """The most embeddings one image of this family can make (the encoder's budget must hold one whole)."""
    return _family(hf_config.model_type).max_tokens(hf_config, folder, kwargs)


def _family(model_type: str):
    if model_type not in _FAMILIES:
        raise ValueError(f"no image preprocessing for model type {model_type!r}; supported: {', '.join(_FAMILIES)}")
    return _FAMILIES[model_type]


def _image_processor(folder: str, kwargs: dict):
    from transformers import AutoImageProcessor

    try:   # Pillow and numpy (torchvision's backend is optional and not a dependency)
        return AutoImageProcessor.from_pretrained(folder, backend="pil", **kwargs)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot read the image processor in {folder} (preprocessor_config.json): {e}") from e


def image_inputs_for(folder: str, hf_config, tokenizer, kwargs: dict | None = None) -> ImageInputs:
    return _family(hf_config.model_type)(folder, hf_config, tokenizer, kwargs or {})


def multimodal_model_types() -> tuple[str, ...]:
    return tuple(_FAMILIES)


@dataclass
class MultiModalPrompt:
    token_ids: list[int]
    features: list[MultiModalFeature]


class MultiModalProcessor:
    """Turns a prompt's token ids and its media into expanded ids and features, under the per-prompt limits."""

    def __init__(self, images: ImageInputs, limits: dict[str, int], media: MediaOptions):
        self.images, self.limits, self.media = images, limits, media

    def apply(self, token_ids: list[int], mm_data: dict[str, Any]) -> MultiModalPrompt:
        raw = media_items(mm_data, "image", "<PIL image or list>")
        items = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        limit = self.limits.get("image", DEFAULT_IMAGE_LIMIT)
        if len(items) > limit:
            raise ValueError(f"the prompt has {len(items)} images, over the limit of {limit} (--limit-mm-per-prompt)")
        pid = self.images.placeholder_id
        slots = [i for i, t in enumerate(token_ids) if t == pid]
        if len(slots) != len(items):
            raise ValueError(f"the prompt has {len(slots)} image placeholder(s) ({self.images.placeholder!r}) but "
                             f"{len(items)} image(s) were given: put one placeholder where each image goes")
        if not items:
            return MultiModalPrompt(list(token_ids), [])
        images = [checked_image(img, self.media, f"image {i}", load=True) for i, img in enumerate(items)]
        try:
            processed = self.images.preprocess(images)
        except Exception as e:  # noqa: BLE001 - a processor's failure on one image is that request's fault
            raise ValueError(f"an image could not be preprocessed: {type(e).__name__}: {e}") from e
        out: list[int] = []
        features = []
        prev = 0
        for slot, (data, n) in zip(slots, processed):
            out.extend(token_ids[prev:slot])
            features.append(MultiModalFeature("image", content_hash("image", data), len(out), n,
                                              {k: TensorData.from_numpy(v) for k, v in data.items()}))
            out.extend([pid] * n)
            prev = slot + 1
        out.extend(token_ids[prev:])
        return MultiModalPrompt(out, features)
