"""A workload's first run in a fresh process with the pre-fault ahead of the handed-out blocks on or off (off:
EngineCore.prefault_ahead does nothing, so pages are first written inside the forwards). Prints the engine's start,
the generate call and the time the pre-fault took within it. Alternate the two in fresh processes:

    for r in 1 2 3 4; do for m in off on; do
        python docs/benchmarks/2026-12-04-w3-decode/prefault_ab.py $m W1; done; done
"""
import sys
import time

from tokenmill import SamplingParams
from tokenmill.bench.datasets import WORKLOADS, random_requests
from tokenmill.engine.engine_core import EngineCore
from tokenmill.entrypoints.llm import LLM

mode, name = sys.argv[1], sys.argv[2]
if mode == "off":
    EngineCore.prefault_ahead = lambda self: None
w = WORKLOADS[name]
t0 = time.perf_counter()
llm = LLM()
start = time.perf_counter() - t0
reqs = random_requests(w["num_prompts"], w["input_len"], w["output_len"], w["prefix_len"], w["dataset_seed"],
                       int(llm.config.model_config.hf_config.vocab_size))
params = SamplingParams(temperature=0.0, max_tokens=w["output_len"], min_tokens=w["output_len"], ignore_eos=True)
llm.engine_core.profile.reset()
t1 = time.perf_counter()
llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
run = time.perf_counter() - t1
prefault = llm.engine_core.profile.seconds.get("prefault_kv", 0.0)
print(f"{mode} {name}: start {start:.2f} s, generate {run:.2f} s (prefault_kv {prefault:.2f} s)", flush=True)
