"""`tokenmill bench spec`: speculation on against off, side by side in one process.

One engine with --speculative-config runs each request of the workload twice in turn, with its proposer
switched off (no drafts: the engine's plain path) and on, so a noisy machine slows both alike and nothing else
differs (a second engine in the same process would not be a fair "off": it runs large batches slower). Reports
TPOT of each and their ratio, acceptance (overall and per draft position), and whether every greedy output is
identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from importlib import resources

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.report import emit
from tokenmill.cli.args import add_engine_args, engine_args_from

MIN_OUTPUT_TOKENS = 32   # W7: TPOT is the mean over requests with at least this many output tokens


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["W7", "W2"], default="W7",
                   help="W7: the 12 chats that repeat Python code, greedy, max_tokens 256, natural stop. W2: one "
                        "random 128-token prompt, 256 forced output tokens.")
    p.add_argument("--num-iters", type=int, default=1, help="Passes over the workload's requests.")
    p.add_argument("--output-json", default=None, help="Save the results here as JSON.")
    add_engine_args(p, positional_model=False)


def _requests(workload: str, llm):
    from tokenmill import SamplingParams

    if workload == "W7":
        chats = json.loads(resources.files("tokenmill.bench").joinpath("data/w7_chats.json").read_text())
        prompts = [llm.input_processor.apply_chat_template(c, True, None) for c in chats]
        ids = [llm.input_processor.process_prompt(p, add_special_tokens=False).prompt_token_ids for p in prompts]
        return ids, SamplingParams(temperature=0.0, max_tokens=256)
    vocab = int(llm.config.model_config.hf_config.vocab_size)
    prompt = random_requests(1, 128, 256, 0, 2, vocab)[0].prompt_token_ids
    return [prompt], SamplingParams(temperature=0.0, max_tokens=256, min_tokens=256, ignore_eos=True)


def _timed(llm, prompt_ids: list[int], params) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    return time.perf_counter() - t0, list(out.outputs[0].token_ids)


def run_spec_bench(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    args = engine_args_from(ns)
    if args.speculative_config is None:
        raise SystemExit("bench spec needs --speculative-config")
    if args.kv_cache_memory is None:
        args.kv_cache_memory = "512MiB"
    args.enable_prefix_caching = False   # every run recomputes its prompt
    on = LLM(**dataclasses.asdict(args))
    runner = on.engine_core.executor.runner
    prompts, params = _requests(ns.workload, on)
    one_token = dataclasses.replace(params, max_tokens=1, min_tokens=0)
    for enabled in (False, True):   # warm-up
        runner.speculation_enabled = enabled
        _timed(on, prompts[0], dataclasses.replace(params, max_tokens=16, min_tokens=0))
    on.spec_decoding_stats = type(on.spec_decoding_stats)()
    rows, identical = [], True
    for _ in range(ns.num_iters):
        for i, prompt in enumerate(prompts):
            row = dict(request=i)
            for name in ("off", "on"):
                runner.speculation_enabled = name == "on"
                ttft, _ = _timed(on, prompt, one_token)
                total, tokens = _timed(on, prompt, params)
                row[name] = dict(ttft_ms=ttft * 1000, output_tokens=len(tokens),
                                 tpot_ms=(total - ttft) / max(len(tokens) - 1, 1) * 1000, tokens=tokens)
            row["identical"] = row["off"]["tokens"] == row["on"]["tokens"]
            identical &= row["identical"]
            rows.append(row)
    counted = [r for r in rows if r["off"]["output_tokens"] >= MIN_OUTPUT_TOKENS] or rows
    tpot = {name: statistics.mean(r[name]["tpot_ms"] for r in counted) for name in ("off", "on")}
    result = dict(workload=ns.workload, speculative_config=on.config.speculative_config.describe(),
                  dtype=on.config.model_config.dtype, quantization=on.config.model_config.quantization,
                  num_requests=len(rows), requests_counted=len(counted), tpot_ms_off=tpot["off"],
                  tpot_ms_on=tpot["on"], tpot_ratio=tpot["on"] / tpot["off"], outputs_identical=identical,
                  **{f"spec_{k}": v for k, v in on.spec_decoding_stats.as_dict().items()},
                  acceptance_per_position=" ".join(f"{r:.3f}" for r in on.spec_decoding_stats.per_position_rates()),
                  per_request=[dict(request=r["request"], identical=r["identical"],
                                    **{f"{n}_{k}": round(r[n][k], 2) for n in ("off", "on")
                                       for k in ("tpot_ms", "ttft_ms", "output_tokens")}) for r in rows])
    emit(result, "Speculative decoding benchmark", ns.output_json)
    return 0
