"""A tiny random LLaVA for the vision benchmark: the tests' tiny Llama language model behind a CLIP tower at
LLaVA-1.5's image size (336 pixels, 14-pixel patches: 576 image tokens a picture), saved with its tokenizer, image
processor and LlavaProcessor (which vLLM reads), so every engine loads the same folder.

    .venv/bin/python benchmarks/make_llava.py /tmp/models/tiny-llava-336
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vision_utils import LLAVA_TEMPLATE  # noqa: E402

from tokenmill.model.source import embedded_model_path  # noqa: E402
from tokenmill.model.tokenizer import load_tokenizer  # noqa: E402


def main(folder: str) -> None:
    tok = copy.deepcopy(load_tokenizer(embedded_model_path()))
    tok.add_tokens(["<image>"], special_tokens=True)
    image_id = tok.convert_tokens_to_ids("<image>")
    tok.chat_template = LLAVA_TEMPLATE
    text = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=image_id + 1, max_position_embeddings=4096,
                                    tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    vision = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                           num_attention_heads=4, image_size=336, patch_size=14)
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                   projector_hidden_act="gelu", vision_feature_layer=-2,
                                   vision_feature_select_strategy="default", image_seq_length=576)
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(folder)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                                vision_feature_select_strategy="default", image_token="<image>",
                                num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE).save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"tiny LLaVA (576 image tokens a picture) in {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
