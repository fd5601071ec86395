"""TTFT with and without the KV offload tier when the working set of system prompts is 4x the KV cache.

16 system prompts of 1,024 tokens (16,384 tokens) against a 4,096-token cache: each is asked in turn, one request
at a time, for 3 rounds with a new question each time. Without the tier every round recomputes every system
prompt (the cache evicted it three prompts ago); with it, rounds 2 and 3 copy the blocks back from host RAM. The
engines alternate in one process (off, on, off), each on the same sequence; the figure is the median TTFT of
rounds 2-3. Greedy tokens are compared too: the tier must change nothing but the time.

    .venv/bin/python benchmarks/offload_ttft.py --out /tmp/bench/offload.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenmill import LLM, SamplingParams

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2   # SmolLM2-135M's bf16 KV


def prompts(n_systems: int = 16, system_len: int = 1024, rounds: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(100, 49152) for _ in range(system_len)] for _ in range(n_systems)]
    return [s + [rng.randrange(100, 49152) for _ in range(24)] for _ in range(rounds) for s in systems]


def run(llm: LLM, seq: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts, tokens = [], []
    for p in seq:
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - t0)
        tokens.append(out.outputs[0].token_ids)
    return ttfts, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seq = prompts()
    cache = f"{4096 * BYTES_PER_TOKEN}"
    engines = {"off": LLM(dtype="bfloat16", kv_cache_memory=cache),
               "on": LLM(dtype="bfloat16", kv_cache_memory=cache, kv_offload_bytes="1GiB")}
    results: dict[str, list] = {"off": [], "on": []}
    tokens: dict[str, list] = {}
    for name in ("off", "on", "off", "on"):
        ttfts, toks = run(engines[name], seq)
        results[name].append(statistics.median(ttfts[16:]))
        tokens.setdefault(name, toks)
    index = engines["on"].engine_core.scheduler.kv_cache_manager.offload
    record = {"working_set_tokens": 16 * 1048, "cache_tokens": 4096,
              "ttft_ms_off": [round(x * 1e3, 1) for x in results["off"]],
              "ttft_ms_on": [round(x * 1e3, 1) for x in results["on"]],
              "ratio_off_over_on": round(statistics.median(results["off"]) / statistics.median(results["on"]), 2),
              "blocks_copied_back": index.stats.loaded_blocks, "blocks_saved": index.stats.saved_blocks,
              "same_tokens": tokens["off"] == tokens["on"]}
    print(json.dumps(record))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
