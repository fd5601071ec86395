"""The host's share of a batch-1 step, warm and after the forward has streamed the weights through the caches.

One decode step's `_prepare_inputs` and `_sampling_metadata` are timed back to back (warm) and each right after
64 MB are streamed through memory, as a decode step's weights are (cold). The gap is why ~1.2 ms of each W2 step
is host time although the same Python takes ~0.1 ms in a loop: every step starts with the interpreter's code and
data out of L2 and L3.

    .venv/bin/python docs/benchmarks/2026-12-02-kernels/host_cold.py
"""

from __future__ import annotations

import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import random_requests
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.worker import model_runner

captured: dict = {}
_prepare = model_runner.ModelRunner._prepare_inputs


def _spy(self, so):
    captured["so"], captured["runner"] = so, self
    return _prepare(self, so)


def median_us(fn, evict: torch.Tensor | None, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        if evict is not None:
            evict.add_(1.0)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e6


def main() -> None:
    model_runner.ModelRunner._prepare_inputs = _spy
    llm = LLM(kv_cache_memory="256MiB")
    prompt = random_requests(1, 128, 256, seed=2)[0].prompt_token_ids
    llm.engine_core.add_request(EngineCoreRequest("w2", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                                               ignore_eos=True), time.time()))
    for _ in range(5):   # the prompt, then decode steps: the last one captured is a batch-1 decode
        llm.engine_core.step()
    so, runner = captured["so"], captured["runner"]
    states = [runner.requests[r] for r in so.num_scheduled_tokens]
    stream = torch.ones(16 << 20)   # 64 MB
    with torch.inference_mode():
        for name, fn in (("prepare_inputs", lambda: _prepare(runner, so)),
                         ("sampling_metadata", lambda: runner._sampling_metadata(states))):
            warm, cold = median_us(fn, None), median_us(fn, stream)
            print(f"{name:18s} warm {warm:7.1f} us   after a 64 MB stream {cold:7.1f} us")


if __name__ == "__main__":
    main()
