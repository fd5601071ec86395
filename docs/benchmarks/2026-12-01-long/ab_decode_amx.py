"""Alternate a setting every engine step, and compare median step times of decode steps."""
import time, sys, statistics
sys.path.insert(0, "/work/shared/peers")
from common import make_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import EngineCoreRequest
llm = LLM(dtype="bfloat16", max_model_len=8192, enable_prefix_caching=False)
core = llm.engine_core
backends = {id(l.backend): l.backend for l in core.executor.runner.model.attention_layers()}
def set_amx(on):
    for b in backends.values(): b.decode_amx = on
def ab(name, prompts, n_out):
    sp = SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{name}-{i}", p, sp.clone() if hasattr(sp, "clone") else SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True), time.time()))
    times = {True: [], False: []}
    k = 0
    while core.has_unfinished_requests():
        on = k % 2 == 0
        set_amx(on)
        t0 = time.perf_counter(); so = core.step(); dt = time.perf_counter() - t0
        sched = core.scheduler
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) and len(sched.running) == len(prompts):
            times[on].append(dt)
        k += 1
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{name}: decode step median amx {a*1e3:.1f} ms vs avx512 {b*1e3:.1f} ms ({len(times[True])}+{len(times[False])} steps) ratio {a/b:.3f}", flush=True)
w1, _ = make_prompts("W1"); w8, _ = make_prompts("W8-1"); w8b, _ = make_prompts("W8")
ab("W1", w1, 128)
ab("W8-1", w8, 64)
ab("W8", w8b, 64)
