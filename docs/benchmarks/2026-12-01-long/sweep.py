"""Scaling sweeps, the same method for tokenmill and vLLM (offline, bf16, greedy, random prompts):
- context: one request of N prompt tokens, TTFT = median wall with max_tokens=1, TPOT = (wall with T output
  tokens - TTFT) / (T - 1), for N in 256 .. 7,936 (T: --tpot-tokens, 64 by default; at 4k-8k prompts the
  prompt's run-to-run noise, ~0.3 s, moves a 64-token TPOT by ~5 ms, so 256 there);
- batch: B requests of 256 prompt tokens at once, 128 output tokens each, output tokens per second of the whole
  run, for B in 1 .. 256.

    python sweep.py --engine tokenmill|vllm [--contexts 256,1024,...] [--batches 1,4,...] [--tpot-tokens T] > out.jsonl
"""

import argparse
import json
import statistics
import time

import numpy as np


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(17, 49152, size=(n, length), dtype=np.int64).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["tokenmill", "vllm"], required=True)
    ap.add_argument("--contexts", default="256,512,1024,2048,4096,7936")
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--tpot-tokens", type=int, default=64)
    a = ap.parse_args()
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model="/tmp/models/smollm2-135m-instruct", dtype="bfloat16", max_model_len=8192,
                  enable_prefix_caching=False, max_num_seqs=256, seed=0)
    else:
        from tokenmill import LLM, SamplingParams
        llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_model_len=8192, max_num_seqs=256)

    def run(batch, n):
        sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(prompts(2, 300, 0), 8)   # warm-up
    for ctx in [int(x) for x in a.contexts.split(",") if x]:
        p = prompts(1, ctx, ctx)
        ttft = statistics.median(run(p, 1) for _ in range(2))
        n = min(a.tpot_tokens, 8192 - ctx)
        total = statistics.median(run(p, n) for _ in range(2))
        print(json.dumps(dict(engine=a.engine, sweep="context", context=ctx, ttft_ms=round(ttft * 1e3, 1),
                              tpot_ms=round((total - ttft) / (n - 1) * 1e3, 2), output_tokens=n)), flush=True)
    for b in [int(x) for x in a.batches.split(",") if x]:
        wall = run(prompts(b, 256, 1000 + b), 128)
        print(json.dumps(dict(engine=a.engine, sweep="batch", batch=b, wall_s=round(wall, 2),
                              output_tok_s=round(b * 128 / wall, 1))), flush=True)


if __name__ == "__main__":
    main()
