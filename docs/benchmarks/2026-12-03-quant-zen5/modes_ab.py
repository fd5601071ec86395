"""A workload of ../shared/peers/common.py (W1 by default) in several weight / KV-cache modes, the engines side by
side in one process and run round-robin, so each mode's wall shares the machine's speed of the moment.

    python modes_ab.py W1 bf16,int8,kvfp8 [rounds]      (int8|int4|gguf: --quantization; kvNAME: --kv-cache-dtype)
"""
import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("PEERS_DIR", "/work/shared/peers"))
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def make(mode: str) -> LLM:
    kw = dict(enable_prefix_caching=False, kv_cache_memory="2GiB")
    if mode in ("int8", "int4", "gguf"):
        kw["quantization"] = mode
    if mode.startswith("kv"):
        kw["kv_cache_dtype"] = mode[2:]
    return LLM(**kw)


workload, modes = sys.argv[1], sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
engines = {m: make(m) for m in modes}
prompts, n = make_prompts(workload)
params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
for engine in engines.values():
    engine.generate([{"prompt_token_ids": list(range(100, 612))}], SamplingParams(max_tokens=8), use_tqdm=False)
for r in range(rounds):
    for m in modes if r % 2 == 0 else modes[::-1]:
        t = time.perf_counter()
        engines[m].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print(json.dumps(dict(round=r, mode=m, wall=round(time.perf_counter() - t, 2))), flush=True)
