"""Wall time a step of the host's functions in W2 (one request, 128 prompt tokens, 256 greedy tokens), each
wrapped with a timer; then varlen_batch alone, hot and after a 300 MB stream through the caches (what a decode
step's weights do to them).

    python host_probe.py [bf16|int8|int4|gguf]
"""
import collections
import sys
import time

import numpy as np

import tokenmill.attention.cpu as cpu
import tokenmill.core.scheduler as sch
import tokenmill.engine.engine_core as ec
import tokenmill.engine.output_processor as op
import tokenmill.worker.model_runner as mr
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import SamplingParams as SP
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import varlen_batch

T = collections.defaultdict(lambda: [0, 0])


def wrap(owner, name):
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter_ns()
        r = f(*a, **k)
        T[name][0] += 1
        T[name][1] += time.perf_counter_ns() - t
        return r
    setattr(owner, name, timed)


mode = sys.argv[1] if len(sys.argv) > 1 else "bf16"
llm = LLM(quantization=None if mode == "bf16" else mode, kv_cache_memory="256MiB", enable_prefix_caching=False)
for name in ("_prepare_inputs", "_sample", "_sampling_metadata"):
    wrap(mr.ModelRunner, name)
wrap(mr, "varlen_batch")
wrap(cpu.CpuPagedBackend, "native_plan")
for name in ("schedule", "update_from_output", "make_stats"):
    wrap(sch.Scheduler, name)
wrap(op.OutputProcessor, "process_outputs")
wrap(ec.EngineCore, "step")
prompt = [{"prompt_token_ids": [(1000 + 11 * j) % 40000 for j in range(128)]}]
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
llm.generate(prompt, sp, use_tqdm=False)
T.clear()
for _ in range(4):
    llm.generate(prompt, sp, use_tqdm=False)
steps = T["step"][0]
for name, (n, ns) in sorted(T.items(), key=lambda kv: -kv[1][1]):
    print(f"{name:22s} {n / steps:4.1f} calls/step {ns / 1e3 / steps:8.1f} us/step")

state = CachedRequestState.create("a", list(range(300)), 128, SP(), list(range(19)), 299, None)
start, n, big = np.array([299]), np.array([1]), np.ones(300 << 17)
for label, flush in (("hot", False), ("after a 300 MB stream", True)):
    ts = []
    for _ in range(100):
        if flush:
            big.sum()
        t = time.perf_counter_ns()
        varlen_batch([state], start, n, 16)
        ts.append(time.perf_counter_ns() - t)
    print(f"varlen_batch alone, {label}: {sorted(ts)[50] / 1e3:.1f} us")
