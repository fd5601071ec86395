"""W1 twice in one engine, its steps timed: the prompt steps (2,048 tokens) and the decode steps (128 rows).

    python w1_steps.py
"""
import sys, time
sys.path.insert(0, "/work/shared/peers")
from common import make_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor import uniproc
times = []
orig = uniproc.UniprocExecutor.execute_model
def timed(self, so):
    t = time.perf_counter(); r = orig(self, so)
    times.append((so.total_num_scheduled_tokens, time.perf_counter() - t)); return r
uniproc.UniprocExecutor.execute_model = timed
llm = LLM(enable_prefix_caching=False)
prompts, n = make_prompts("W1")
sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
for r in range(2):
    times.clear()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
    w = time.perf_counter() - t
    big = [b for a, b in times if a > 128]
    small = [b for a, b in times if a <= 128]
    print(r, round(w, 2), "steps", len(times), "prompt steps", len(big), "sum", round(sum(big), 2), "median ms", round(sorted(big)[len(big)//2]*1e3, 1),
          "| decode steps", len(small), "sum", round(sum(small), 2), "median ms", round(sorted(small)[len(small)//2]*1e3, 1), flush=True)
    print([(a, round(b*1e3)) for a, b in times[:20]])
