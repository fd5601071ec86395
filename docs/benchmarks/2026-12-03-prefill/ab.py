"""One switch of this stop flipped run by run in one engine, so both sides share every minute of this host's
drifting speed; prints each run's wall time, the ratios and whether the tokens were the same.

  switch=prompt_kernel  the native prompt-attention kernel, or SDPA's flash attention (what CPUs without AMX ran
                        before); prefix caching off, except for W3 (reset before every run)
  switch=stack          the native decoder stack, or the eager Python layers (what decode steps past 8 rows ran
                        on CPUs without AMX before); prefix caching on and not reset, so after the first run the
                        prompts are cached and the runs are decode steps

    python docs/benchmarks/2026-12-03-prefill/ab.py switch=prompt_kernel|stack [workload=W1|W3|W8-1]
        [num_prompts=N] [rounds=3] [results=FILE]
"""
import json
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.attention.cpu import CpuPagedBackend
from tokenmill.bench.datasets import random_requests

opts = dict(a.split("=", 1) for a in sys.argv[1:])
switch, workload, rounds = opts["switch"], opts.get("workload", "W1"), int(opts.get("rounds", 3))
shape = {"W1": dict(num_prompts=128, input_len=256, output_len=128),
         "W3": dict(num_prompts=64, input_len=32, output_len=64, prefix_len=1024),
         "W8-1": dict(num_prompts=1, input_len=7936, output_len=1)}[workload]
shape["num_prompts"] = int(opts.get("num_prompts", shape["num_prompts"]))
caching = switch == "stack" or workload == "W3"
llm = LLM(enable_prefix_caching=caching)
model = llm.engine_core.executor.runner.model
reqs = random_requests(shape["num_prompts"], shape["input_len"], shape["output_len"], shape.get("prefix_len", 0))
prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
n_out = shape["output_len"]
sp = SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True)
llm.generate(prompts[:8], sp, use_tqdm=False)   # builds the stack
backends = [m.backend for m in model.modules() if isinstance(getattr(m, "backend", None), CpuPagedBackend)]
native_prompt, stack = backends[0]._prefill_op, model.model.native_stack


def flip(on: bool) -> None:
    if switch == "stack":
        model.model.native_stack = stack if on else None
    else:
        for b in backends:
            b._prefill_op = native_prompt if on else None


def run(on: bool) -> tuple[float, list]:
    flip(on)
    if workload == "W3":   # every run starts cold, then the shared prefix is cached by the first request
        llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


run(True)
walls: dict[str, list[float]] = {"on": [], "off": []}
tokens = {}
for r in range(rounds):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
        wall, tokens[on] = run(on)
        walls["on" if on else "off"].append(round(wall, 2))
row = {"switch": switch, "workload": workload, "num_prompts": shape["num_prompts"], "walls_s": walls,
       "ratios": [round(a / b, 3) for a, b in zip(walls["on"], walls["off"])],
       "same_tokens": tokens[True] == tokens[False], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
print(json.dumps(row))
if "results" in opts:
    with open(opts["results"], "a") as f:
        f.write(json.dumps(row) + "\n")
