"""The first write of W1's KV cache in an engine's process, as the forward does it: 3,072 blocks (128 requests x
384 tokens), two blocks at a time across the 30 layers' K and V, then the same writes again (pages backed).

    python kv_first_touch.py
"""
import time

from tokenmill import LLM

llm = LLM(enable_prefix_caching=False, kv_cache_memory="4GiB")
caches = llm.engine_core.executor.runner.kv_caches
blocks = 3072
gb = sum(c[:, 1:blocks + 1].numel() * c.element_size() for c in caches) / 1e9
for label in ("first", "second"):
    t = time.perf_counter()
    for b in range(1, blocks + 1, 2):
        for c in caches:
            c[:, b:b + 2].fill_(1)
    dt = time.perf_counter() - t
    print(f"{label} write of {gb:.2f} GB: {dt:.2f} s ({gb / dt:.2f} GB/s)", flush=True)
