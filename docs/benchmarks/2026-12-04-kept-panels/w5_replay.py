"""W5's scheduling replayed without a model: the real Scheduler and KV-cache manager, W5's 128 prompts (64..1,024
tokens, 128 out, all at once), a fake runner that samples one token per request whose prompt is done. Prints the
peak of running requests, preemptions, and prompt tokens thrown away by preemption, for the bf16 cache's 728 blocks
and fp8's 1,456 (256 MiB of SmolLM2's cache).
    .venv/bin/python docs/benchmarks/2026-12-04-kept-panels/w5_replay.py
"""

from __future__ import annotations

from tokenmill.bench.datasets import WORKLOADS, random_requests
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def replay(num_blocks: int) -> dict:
    w = WORKLOADS["W5"]
    prompts = random_requests(w["num_prompts"], w["input_len"], w["output_len"], 0, w["dataset_seed"],
                              min_input_len=w["min_input_len"])
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192),
                  CacheConfig(block_size=16, num_blocks=num_blocks))
    lost = 0
    preempt = s._preempt

    def counting_preempt(req):
        nonlocal lost
        lost += req.num_computed_tokens
        preempt(req)

    s._preempt = counting_preempt
    for i, p in enumerate(prompts):
        s.add_request(Request(str(i), p.prompt_token_ids, SamplingParams(max_tokens=p.output_len, ignore_eos=True),
                              p.output_len, 16, arrival_time=float(i)))
    steps = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        steps += 1
        ids = list(so.num_scheduled_tokens)
        done = [[1] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        s.update_from_output(so, ModelRunnerOutput(ids, done))
    return dict(blocks=num_blocks, peak_running=s.peak_num_running, preemptions=s.num_preemptions,
                tokens_recomputed=lost, steps=steps)


if __name__ == "__main__":
    bf16, fp8 = replay(728), replay(1456)
    print("bf16", bf16)
    print("fp8 ", fp8)
    print("peak ratio %.3f" % (fp8["peak_running"] / bf16["peak_running"]))
