"""Prompt steps with the last layer run for the sampled rows only (as the engine does now) against every row
(the runner's choice switched off), alternated in one engine so both see the same minutes of this host.

    python rows_ab.py W2 [rounds=5] [reps=20]     # time to the first token of W2's 128-token prompt
    python rows_ab.py W8-1 [rounds=3] [reps=1]    # ... of W8-1's 7,936-token prompt
    python rows_ab.py W1 [rounds=3] [reps=1]      # W1's wall time (128 prompts of 256, 128 tokens out)
"""
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import WORKLOADS, random_requests
from tokenmill.worker.model_runner import ModelRunner

workload = sys.argv[1]
opts = dict(a.split("=", 1) for a in sys.argv[2:])
rounds, reps = int(opts.get("rounds", 3)), int(opts.get("reps", 1))
w = dict(WORKLOADS[workload])
w.pop("kv_cache_memory", None)
seed = w.pop("dataset_seed")
reqs = random_requests(seed=seed, **w)
prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
out_len = reqs[0].output_len if workload == "W1" else 1
sp = SamplingParams(max_tokens=out_len, min_tokens=out_len, temperature=0, ignore_eos=True)
llm = LLM(enable_prefix_caching=False, kv_cache_memory="2GiB")
chooses = ModelRunner._only_logits_rows_used
times: dict[str, list[float]] = {"sampled rows": [], "every row": []}
llm.generate(prompts[:1], sp, use_tqdm=False)
for r in range(rounds):
    for mode in (list(times) if r % 2 == 0 else list(reversed(times))):
        ModelRunner._only_logits_rows_used = chooses if mode == "sampled rows" else (lambda self, states: False)
        for _ in range(reps):
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times[mode].append(time.perf_counter() - t)
med = {m: statistics.median(v) for m, v in times.items()}
print(workload, {m: f"median {v * 1e3:.1f} ms of {len(times[m])}" for m, v in med.items()},
      f"ratio {med['sampled rows'] / med['every row']:.3f}")
