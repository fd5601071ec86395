"""W2's TTFT split into the step (`execute_model`: the 128-token prompt's forward and the first token's sampling)
and the rest of `LLM.generate` (request in, output out): medians of 15 one-token requests, after 3 warm-ups.

    python docs/benchmarks/2026-12-03-sweeps/ttft_parts.py
"""
import statistics
import time

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.executor import uniproc

steps = []
execute = uniproc.UniprocExecutor.execute_model


def timed(self, so):
    t = time.perf_counter()
    out = execute(self, so)
    steps.append(time.perf_counter() - t)
    return out


uniproc.UniprocExecutor.execute_model = timed
llm = LLM(enable_prefix_caching=False)
prompt = {"prompt_token_ids": np.random.default_rng(0).integers(17, 49152, size=128).tolist()}
for _ in range(3):
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
walls, forwards = [], []
for _ in range(15):
    steps.clear()
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    walls.append(time.perf_counter() - t)
    forwards.append(sum(steps))
print(f"TTFT median {statistics.median(walls) * 1e3:.2f} ms (best {min(walls) * 1e3:.2f}); execute_model median "
      f"{statistics.median(forwards) * 1e3:.2f} ms (best {min(forwards) * 1e3:.2f})")
