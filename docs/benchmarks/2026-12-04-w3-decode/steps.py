"""A workload's steps in one engine, round after round: the wall time, the steps that are not pure decodes (tokens,
ms) and the decode steps' median and sum. It also prints the CLOCK_MONOTONIC window of the decode steps, so that
`perf record -k CLOCK_MONOTONIC ... python steps.py W3` can be read for those steps alone with
`perf report --time START,END`.

    python docs/benchmarks/2026-12-04-w3-decode/steps.py W3|W1 [rounds]
"""
import sys
import time

from tokenmill import SamplingParams
from tokenmill.bench.datasets import WORKLOADS, random_requests
from tokenmill.entrypoints.llm import LLM
from tokenmill.worker.model_runner import ModelRunner

name = sys.argv[1] if len(sys.argv) > 1 else "W3"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
w = WORKLOADS[name]
llm = LLM(enable_prefix_caching=True)
reqs = random_requests(w["num_prompts"], w["input_len"], w["output_len"], w["prefix_len"], w["dataset_seed"],
                       int(llm.config.model_config.hf_config.vocab_size))
log = []   # (tokens, seconds, monotonic start, monotonic end) of each step
execute = ModelRunner.execute_model


def timed(self, so):
    t, m0 = time.perf_counter(), time.monotonic()
    out = execute(self, so)
    log.append((so.total_num_scheduled_tokens, time.perf_counter() - t, m0, time.monotonic()))
    return out


ModelRunner.execute_model = timed
params = SamplingParams(temperature=0.0, max_tokens=w["output_len"], min_tokens=w["output_len"], ignore_eos=True)
for _ in range(rounds):
    llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    log.clear()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    other = [(n, round(s * 1e3, 1)) for n, s, *_ in log if n != w["num_prompts"]]
    decode = sorted(s for n, s, *_ in log if n == w["num_prompts"])
    window = [e for e in log if e[0] == w["num_prompts"]]
    more = " ..." if len(other) > 6 else ""
    print(f"wall {wall:.2f} s, {len(log)} steps; other steps (tokens, ms) {other[:6]}{more}; "
          f"{len(decode)} decode steps, median {decode[len(decode) // 2] * 1e3:.1f} ms, sum {sum(decode):.2f} s; "
          f"decode window {window[0][2]:.6f},{window[-1][3]:.6f}", flush=True)
