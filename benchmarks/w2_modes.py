"""W2 (one request, 128 random prompt tokens, 256 greedy output tokens) in each weight mode, the engines loaded
side by side in one process and run round-robin, so each mode's TPOT is measured in the same minutes as bf16's
(this host's speed drifts by 1.5x within minutes). TPOT = (wall of 256 tokens - wall of 1 token) / 255.

    python benchmarks/w2_modes.py [rounds=5] [results=FILE] [enforce_eager=1]
"""
import json
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams

opts = dict(a.split("=", 1) for a in sys.argv[1:])
rounds = int(opts.get("rounds", 5))
eager = opts.get("enforce_eager") == "1"
modes = {"bf16": None, "int8": "int8", "int4": "int4", "gguf": "gguf"}
engines = {m: LLM(quantization=q, kv_cache_memory="256MiB", enable_prefix_caching=False, enforce_eager=eager)
           for m, q in modes.items()}
prompt = [{"prompt_token_ids": [(1000 + 11 * j) % 40000 for j in range(128)]}]


def wall(llm: LLM, n: int) -> float:
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


tpot: dict[str, list[float]] = {m: [] for m in modes}
for llm in engines.values():
    wall(llm, 8)   # warm-up
for r in range(rounds):
    order = list(modes) if r % 2 == 0 else list(reversed(modes))
    for m in order:
        first, full = wall(engines[m], 1), wall(engines[m], 256)
        tpot[m].append(round((full - first) / 255 * 1e3, 2))
med = {m: statistics.median(v) for m, v in tpot.items()}
row = {"enforce_eager": eager, "tpot_ms": tpot, "median_ms": med,
       "vs_bf16": {m: round(med[m] / med["bf16"], 3) for m in modes}, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
print(json.dumps(row))
if "results" in opts:
    with open(opts["results"], "a") as f:
        f.write(json.dumps(row) + "\n")
