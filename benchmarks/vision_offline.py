"""Image prompts offline, tokenmill against transformers on the same folder, back to back (tokenmill, HF,
tokenmill): 32 prompts of one generated 640x480 picture and a question, 32 greedy tokens each, in bf16.
transformers runs them one at a time (its generate has no continuous batching); tokenmill all at once.

    .venv/bin/python benchmarks/vision_offline.py /tmp/models/tiny-llava-336 --out /tmp/bench/vision_offline.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "USER: <image>\nDescribe the picture in detail.ASSISTANT:"


def images(n: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(n)]


def run_tokenmill(folder: str, imgs: list, out_len: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", kv_cache_memory="1GiB")
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    del llm
    return dict(engine="tokenmill", elapsed_s=wall, tokens=tokens)


def run_hf(folder: str, imgs: list, out_len: int) -> dict:
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    proc = transformers.AutoProcessor.from_pretrained(folder, backend="pil")
    t0 = time.perf_counter()
    tokens = []
    with torch.no_grad():
        for im in imgs:
            enc = proc(text=PROMPT, images=[im], return_tensors="pt")
            enc["pixel_values"] = enc["pixel_values"].to(torch.bfloat16)
            out = model.generate(**enc, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
            tokens.append(out[0, enc["input_ids"].shape[1]:].tolist())
    return dict(engine="transformers", elapsed_s=time.perf_counter() - t0, tokens=tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    imgs = images(a.num_prompts)
    runs = [run_tokenmill(a.folder, imgs, a.output_len), run_hf(a.folder, imgs, a.output_len),
            run_tokenmill(a.folder, imgs, a.output_len)]
    same = [sum(x == y for x, y in zip(r["tokens"], runs[1]["tokens"])) for r in (runs[0], runs[2])]
    result = dict(date=time.strftime("%Y-%m-%d"), num_prompts=a.num_prompts, output_len=a.output_len,
                  tokenmill_s=[runs[0]["elapsed_s"], runs[2]["elapsed_s"]], transformers_s=runs[1]["elapsed_s"],
                  prompts_with_equal_tokens=same)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
