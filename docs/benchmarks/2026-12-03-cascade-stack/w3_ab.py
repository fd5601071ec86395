"""W3 (prefix caching on) with shared-prefix decode steps in the native decoder stack (on) or in the Python
layers (off: the stack declines steps with a prefix, as before this change), alternated in one engine: each
round resets the prefix cache, so both pay the same prompt work.

    python w3_ab.py [rounds]
"""
import json
import sys
import time

sys.path.insert(0, "/work/shared/peers")
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.executor import uniproc  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
steps: list[tuple[int, float]] = []
execute = uniproc.UniprocExecutor.execute_model


def timed(self, so):
    t = time.perf_counter()
    out = execute(self, so)
    steps.append((so.total_num_scheduled_tokens, time.perf_counter() - t))
    return out


uniproc.UniprocExecutor.execute_model = timed
llm = LLM(enable_prefix_caching=True)
stack = llm.engine_core.executor.runner.model.model.native_stack
prompts, n = make_prompts("W3")
sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)   # first touch of the pages
for r in range(rounds):
    for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
        stack.cached_keys = mode == "on"
        assert llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
        steps.clear()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        decode = sorted(s for tokens, s in steps if tokens == len(prompts))
        print(json.dumps({"round": r, "cascade_in_stack": mode, "wall": round(wall, 3), "steps": len(steps),
                          "decode_step_median_ms": round(decode[len(decode) // 2] * 1e3, 2)}), flush=True)
