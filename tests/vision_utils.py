"""Tiny random LLaVA folders (transformers' own classes, saved as a user's checkpoint would be), images, and
transformers' greedy reference through its own LlavaProcessor."""

from __future__ import annotations

import base64
import copy
import io
from pathlib import Path

import numpy as np
import torch

# LLaVA-1.5's conversation layout, taking OpenAI-style content parts
LLAVA_TEMPLATE = ("{% for m in messages %}{{ 'USER: ' if m['role'] == 'user' else 'ASSISTANT: ' }}"
                  "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                  "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
                  "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
QUESTION = "USER: <image>\nWhat is in the picture?ASSISTANT:"


def build_tiny_llava(folder: Path, tokenizer, strategy: str = "default", feature_layer=-2) -> Path:
    import transformers

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<image>"], special_tokens=True)
    image_id = tok.convert_tokens_to_ids("<image>")
    tok.chat_template = LLAVA_TEMPLATE
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=image_id + 1, max_position_embeddings=1024,
                                    tie_word_embeddings=False, initializer_range=0.3, rms_norm_eps=1e-6,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=56, patch_size=14, initializer_range=0.3)
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                   projector_hidden_act="gelu", vision_feature_layer=feature_layer,
                                   vision_feature_select_strategy=strategy)
    torch.manual_seed(1234)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 56},
                                    crop_size={"height": 56, "width": 56}).save_pretrained(folder)
    return Path(folder)


def random_image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


class LlavaReference:
    """transformers' LlavaForConditionalGeneration and LlavaProcessor on a folder, greedy in fp32."""

    def __init__(self, folder: Path):
        import transformers

        self.model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        cfg = self.model.config
        self.processor = transformers.LlavaProcessor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(folder, backend="pil"),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder), patch_size=cfg.vision_config.patch_size,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy, image_token="<image>",
            num_additional_image_tokens=1)

    def greedy(self, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
        """The expanded prompt ids, the greedy tokens, and each step's logits [steps, vocab]."""
        enc = self.processor(text=prompt, images=images, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        n = enc["input_ids"].shape[1]
        return enc["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), torch.cat(out.logits)


QWEN_QUESTION = "<|vision_start|><|image_pad|><|vision_end|>What is in the picture?"
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's way of writing an image part (the rest of its chat template left out)
QWEN_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                 "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")


def build_tiny_qwen2_vl(folder: Path, tokenizer, v25: bool = False) -> Path:
    """Qwen2-VL (or Qwen2.5-VL: windows of 2x2 merged units, blocks 1 of 3 full) with M-RoPE sections [2, 3, 3]
    of a 16-wide head, images between 56x56 and 8x8 patches of 28."""
    import transformers

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(QWEN_TOKENS, special_tokens=True)
    start, end, image, video = tok.convert_tokens_to_ids(QWEN_TOKENS)
    tok.chat_template = QWEN_TEMPLATE
    vision = (dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, window_size=56,
                   fullatt_block_indexes=[1], hidden_act="silu") if v25 else
              dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2))
    cfg = (transformers.Qwen2_5_VLConfig if v25 else transformers.Qwen2VLConfig)(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=video + 1, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=False, initializer_range=0.3, bos_token_id=None, eos_token_id=None),
        vision_config=dict(**vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           initializer_range=0.3),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(1234)
    (transformers.Qwen2_5_VLForConditionalGeneration if v25 else
     transformers.Qwen2VLForConditionalGeneration)(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    pixels = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}   # min_pixels and max_pixels
    transformers.Qwen2VLImageProcessor(size=pixels).save_pretrained(folder)
    return Path(folder)


class Qwen2VLReference:
    """transformers' Qwen2VLForConditionalGeneration on its image processor's output. (Qwen2VLProcessor needs a
    video processor, which needs torchvision: the prompt is expanded here by the documented rule instead, one
    <|image_pad|> per 2x2 patches of the image's grid; M-RoPE's positions are transformers' own.)"""

    def __init__(self, folder: Path, **processor_kwargs):
        import transformers

        self.model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.images = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil", **processor_kwargs)
        self.pad = self.model.config.image_token_id

    def greedy(self, prompt: str, images: list, max_new_tokens: int):
        enc = self.images(images=images, return_tensors="pt")
        counts = iter((enc["image_grid_thw"].prod(-1) // 4).tolist())
        ids = []
        for t in self.tokenizer(prompt, add_special_tokens=False).input_ids:
            ids.extend([t] * next(counts) if t == self.pad else [t])
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      mm_token_type_ids=(input_ids == self.pad).int(),
                                      pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                                      max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        return ids, out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)
