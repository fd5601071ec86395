"""The native decoder stack off and on in one engine, alternated: ms per output token and whether every output
token is the same. Each run is the same requests (128 random prompt tokens each), greedy, `out` tokens forced.

    python docs/benchmarks/2026-12-01-stack/ab_stack.py batch=1 [out=128] [reps=3] [quantization=gguf] ...
"""
import json
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.model.native_stack import NativeDecoderStack

kw: dict = {}
for arg in sys.argv[1:]:
    k, v = arg.split("=", 1)
    kw[k] = int(v) if v.isdigit() else v
batch, out, reps = kw.pop("batch", 1), kw.pop("out", 128), kw.pop("reps", 3)
results = kw.pop("results", None)
llm = LLM(enable_prefix_caching=False, **kw)
model = llm.engine_core.executor.runner.model.model
sp = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
prompts = [{"prompt_token_ids": [(1000 + 37 * i + 11 * j) % 40000 for j in range(128)]} for i in range(batch)]


def run() -> tuple[float, list]:
    t = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=False)
    return (time.perf_counter() - t) / out * 1e3, [r.outputs[0].token_ids for r in res]


run()  # warm-up
times: dict[str, list[float]] = {"eager": [], "stack": []}
outputs: dict[str, list] = {}
for i in range(reps):
    for mode in ("eager", "stack") if i % 2 == 0 else ("stack", "eager"):
        model.native_stack = None if mode == "eager" else NativeDecoderStack(model)
        ms, tokens = run()
        times[mode].append(round(ms, 2))
        outputs.setdefault(mode, tokens)
eager, stack = statistics.median(times["eager"]), statistics.median(times["stack"])
row = {"batch": batch, "out": out, **kw, "eager_ms": times["eager"], "stack_ms": times["stack"],
       "ratio": round(stack / eager, 3), "identical": outputs["eager"] == outputs["stack"],
       "date": time.strftime("%Y-%m-%d %H:%M:%S")}
print(json.dumps(row))
if results:
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
