"""transformers' generate on the same GPU and model as device_check.sh's tokenmill runs: W2 (one request, 128 prompt
tokens, 256 greedy output tokens: TTFT and TPOT) and W1 (128 requests of 256 prompt tokens and 128 output tokens,
one batch: wall time). Random prompt tokens, as the bench's random dataset; eos ignored."""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoModelForCausalLM


def generate(model, ids: torch.Tensor, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                   min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    one = torch.randint(100, 49000, (1, 128), generator=g).cuda()
    generate(model, one, 8)   # warm-up
    ttft = min(generate(model, one, 1) for _ in range(3))
    total = min(generate(model, one, 256) for _ in range(2))
    print(f"transformers W2: TTFT {ttft * 1e3:.1f} ms, TPOT {(total - ttft) / 255 * 1e3:.2f} ms")
    batch = torch.randint(100, 49000, (128, 256), generator=g).cuda()
    generate(model, batch[:8], 4)
    wall = generate(model, batch, 128)
    print(f"transformers W1: {wall:.2f} s, {128 * 128 / wall:.0f} output tok/s")


if __name__ == "__main__":
    main(sys.argv[1])
