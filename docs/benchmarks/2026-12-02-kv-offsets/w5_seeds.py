"""W5's peak concurrent requests for a bf16 cache (728 blocks of 256 MiB) and an fp8 one (1,456), over many
draws of the workload's prompt lengths: the scheduler alone with a stand-in model that samples one token per
finished prompt, which schedules exactly as the engine does (lengths are forced, so tokens do not matter).
Seed 5 is the workload's own (`bench throughput --workload W5`: 23 and 43 requests, measured on the engine).

    .venv/bin/python docs/benchmarks/2026-12-02-kv-offsets/w5_seeds.py [SEEDS]
"""

from __future__ import annotations

import json
import statistics
import sys

from tokenmill.bench.datasets import WORKLOADS, random_requests
from tokenmill.config import CacheConfig, EngineArgs, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE, MAX_MODEL_LEN = 16, 8192


def peak_running(seed: int, num_blocks: int) -> tuple[int, int, float]:
    """(peak requests running in one step, preemptions, mean requests running per step while all 128 were in
    the system: from the first step to the first finish)"""
    w, args = WORKLOADS["W5"], EngineArgs()
    sched = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, MAX_MODEL_LEN),
                      CacheConfig(BLOCK_SIZE, num_blocks, True))
    reqs = random_requests(w["num_prompts"], w["input_len"], w["output_len"], seed=seed,
                           min_input_len=w["min_input_len"])
    sp = SamplingParams(max_tokens=w["output_len"], min_tokens=w["output_len"], ignore_eos=True, temperature=0)
    for i, r in enumerate(reqs):
        sched.add_request(Request(str(i), r.prompt_token_ids, sp, w["output_len"], BLOCK_SIZE))
    counts = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if len(sched.requests) == len(reqs):
            counts.append(len(sched.running))
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            req = sched.requests[rid]
            ids.append(rid)
            sampled.append([1000] if req.num_computed_tokens >= req.num_tokens else [])
        sched.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return sched.peak_num_running, sched.num_preemptions, statistics.mean(counts)


def main() -> None:
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    ratios, mean_ratios = [], []
    for seed in seeds:
        (bf16, p1, m1), (fp8, p2, m2) = peak_running(seed, 728), peak_running(seed, 1456)
        ratios.append(fp8 / bf16)
        mean_ratios.append(m2 / m1)
        print(json.dumps({"seed": seed, "peak_bf16": bf16, "peak_fp8": fp8, "peak_ratio": round(fp8 / bf16, 3),
                          "mean_bf16": round(m1, 2), "mean_fp8": round(m2, 2), "mean_ratio": round(m2 / m1, 3),
                          "preemptions": [p1, p2]}), flush=True)
    print(json.dumps({"seeds": len(ratios), "peak_ratio_mean": round(statistics.mean(ratios), 3),
                      "peak_ratio_min": round(min(ratios), 3), "peak_ratio_max": round(max(ratios), 3),
                      "mean_running_ratio_mean": round(statistics.mean(mean_ratios), 3)}))


if __name__ == "__main__":
    main()
