"""Whole prompts in the native decoder stack (on) or in the Python layers (off: the stack declines steps with a
prompt, as before this change), alternated in one engine: W2's TTFT (one 128-token prompt, then its first token)
and a workload's wall.

    python prompts_ab.py W2 [rounds]      python prompts_ab.py W1 [rounds]
"""
import json
import sys
import time

sys.path.insert(0, "/work/shared/peers")
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

workload = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
llm = LLM(enable_prefix_caching=False, kv_cache_memory="2GiB")
stack = llm.engine_core.executor.runner.model.model.native_stack
prompts, n = make_prompts(workload)
batch = [{"prompt_token_ids": p} for p in prompts]
llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True), use_tqdm=False)
for r in range(rounds):
    for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
        stack.prompts = mode == "on"
        if workload == "W2":   # TTFT: the prompt step and one token, best of 10
            best = 1e9
            for _ in range(10):
                t = time.perf_counter()
                llm.generate(batch, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                best = min(best, time.perf_counter() - t)
            print(json.dumps({"round": r, "prompts_in_stack": mode, "ttft_ms": round(best * 1e3, 2)}), flush=True)
        else:
            t = time.perf_counter()
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            print(json.dumps({"round": r, "prompts_in_stack": mode, "wall": round(time.perf_counter() - t, 3)}),
                  flush=True)
