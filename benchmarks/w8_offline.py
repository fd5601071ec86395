"""W8 and W8-1 offline, the same method for tokenmill and vLLM: TTFT = median wall of the requests with
max_tokens=1, TPOT = (wall with 128 output tokens - TTFT) / 127. Prompts from ../shared/peers/common.py.

    python w8_offline.py --engine tokenmill|vllm [--workloads W8-1,W8] [--iters 2]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("PEERS_DIR", "/work/shared/peers"))
from common import make_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["tokenmill", "vllm"], required=True)
    ap.add_argument("--workloads", default="W8-1,W8")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=a.model or "/tmp/models/smollm2-135m-instruct", dtype="bfloat16", max_model_len=8192,
                  enable_prefix_caching=False, seed=0)
        prompt = lambda p: {"prompt_token_ids": p}  # noqa: E731
    else:
        from tokenmill import LLM, SamplingParams
        llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_model_len=8192)
        prompt = lambda p: {"prompt_token_ids": p}  # noqa: E731

    def run(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([prompt(p) for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run([list(range(100, 612))], 8)   # warm-up
    for w in a.workloads.split(","):
        prompts, n_out = make_prompts(w)
        ttft = statistics.median(run(prompts, 1) for _ in range(a.iters))
        total = statistics.median(run(prompts, n_out) for _ in range(a.iters))
        print(json.dumps(dict(engine=a.engine, workload=w, requests=len(prompts), input_len=len(prompts[0]),
                              output_len=n_out, ttft_ms=round(ttft * 1e3, 1),
                              tpot_ms=round((total - ttft) / (n_out - 1) * 1e3, 2), wall_s=round(total, 2))),
              flush=True)


if __name__ == "__main__":
    main()
