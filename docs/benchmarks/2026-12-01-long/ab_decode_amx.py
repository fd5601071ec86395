"""The decode kernel's two scoring paths in one engine, switched every step (AMX tiles / AVX-512 gathers), and the
median decode-step time of each: the host's drift hits both alike. W1, W8-1 and W8 prompts from the peers."""

import statistics
import sys
import time

sys.path.insert(0, "/work/shared/peers")
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.messages import EngineCoreRequest  # noqa: E402

llm = LLM(dtype="bfloat16", max_model_len=8192, enable_prefix_caching=False)
core = llm.engine_core
backends = {id(layer.backend): layer.backend for layer in core.executor.runner.model.attention_layers()}


def set_amx(on: bool) -> None:
    for b in backends.values():
        b.decode_amx = on


def ab(name: str, prompts: list[list[int]], n_out: int) -> None:
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"{name}-{i}", p, sp, time.time()))
    times: dict[bool, list[float]] = {True: [], False: []}
    k = 0
    while core.has_unfinished_requests():
        on = k % 2 == 0
        set_amx(on)
        t0 = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t0
        running = core.scheduler.running
        if len(running) == len(prompts) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            times[on].append(dt)   # a decode step of every request
        k += 1
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{name}: decode step median amx {a * 1e3:.1f} ms vs avx512 {b * 1e3:.1f} ms "
          f"({len(times[True])}+{len(times[False])} steps) ratio {a / b:.3f}", flush=True)


for workload, n_out in [("W1", 128), ("W8-1", 64), ("W8", 64)]:
    ab(workload, make_prompts(workload)[0], n_out)
