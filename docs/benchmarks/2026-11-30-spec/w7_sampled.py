"""W7's chats with sampling (temperature 0.8, top-p 0.95, a seed per request, max_tokens 256, natural stop), one
engine with its proposer switched off and on for each request in turn, as `tokenmill bench spec` does for greedy.
TPOT = (full time - 1-token time) / (tokens - 1), the mean over requests with >= 32 tokens.

  .venv/bin/python w7_sampled.py '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}'
"""
import json
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

CHATS = json.loads((Path(__file__).resolve().parents[3] / "tokenmill/bench/data/w7_chats.json").read_text())


def main():
    llm = LLM(dtype="bfloat16", kv_cache_memory="512MiB", enable_prefix_caching=False,
              speculative_config=json.loads(sys.argv[1]))
    runner = llm.engine_core.executor.runner
    llm.chat([CHATS[0]], SamplingParams(max_tokens=16), use_tqdm=False)
    tpot = {"off": [], "on": []}
    for i, chat in enumerate(CHATS):
        for name in ("off", "on"):
            runner.speculation_enabled = name == "on"
            sp = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=256)
            t0 = time.perf_counter()
            llm.chat([chat], SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=1), use_tqdm=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = len(llm.chat([chat], sp, use_tqdm=False)[0].outputs[0].token_ids)
            if n >= 32:
                tpot[name].append(((time.perf_counter() - t0) - ttft) / (n - 1) * 1e3)
    off, on = (sum(v) / len(v) for v in (tpot["off"], tpot["on"]))
    print("RESULT " + json.dumps(dict(spec=json.loads(sys.argv[1]), tpot_ms_off=round(off, 2), tpot_ms_on=round(on, 2),
                                      ratio=round(on / off, 3), counted=(len(tpot["off"]), len(tpot["on"])),
                                      **llm.spec_decoding_stats.as_dict())))


if __name__ == "__main__":
    main()
