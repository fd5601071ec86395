"""Time to first token of one prompt (128 and 2,048 tokens) in int8, int4 and bf16, the engines side by side in one
process, best of 4 alternated rounds, ms.

    python ttft_modes.py
"""
import time

from tokenmill import LLM, SamplingParams

engines = {m: LLM(quantization=m, enable_prefix_caching=False, kv_cache_memory="1GiB") for m in ("int8", "int4")}
engines["bf16"] = LLM(enable_prefix_caching=False, kv_cache_memory="1GiB")
sp = SamplingParams(max_tokens=1, temperature=0)
for n in (128, 2048):
    p = [{"prompt_token_ids": [(1000 + 11 * j) % 40000 for j in range(n)]}]
    res = {m: [] for m in engines}
    for _ in range(4):
        for m, e in engines.items():
            t = time.perf_counter()
            e.generate(p, sp, use_tqdm=False)
            res[m].append((time.perf_counter() - t) * 1e3)
    print(n, {m: round(min(v), 1) for m, v in res.items()}, flush=True)
