"""W3 twice in one engine (prefix caching on), with the time Python's garbage collector took in each: the first
round also pays the first touch of the KV cache's pages, the second reuses them.

    python w3_rounds.py
"""
import gc
import sys
import time

sys.path.insert(0, "/work/shared/peers")
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

spent = {"t": 0.0, "n": [0, 0, 0], "start": 0.0}


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        spent["start"] = time.perf_counter()
    else:
        spent["t"] += time.perf_counter() - spent["start"]
        spent["n"][info["generation"]] += 1


llm = LLM(enable_prefix_caching=True)
prompts, n = make_prompts("W3")
sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
gc.callbacks.append(on_gc)
for r in range(2):
    spent["t"], spent["n"] = 0.0, [0, 0, 0]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    print(f"round {r}: wall {time.perf_counter() - t:.2f} s, gc {spent['t'] * 1e3:.1f} ms, collections by "
          f"generation {spent['n']}", flush=True)
