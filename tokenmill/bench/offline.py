"""`tokenmill bench throughput` and `tokenmill bench latency`, shaped like vLLM's."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from tokenmill.bench.datasets import apply_workload, random_requests
from tokenmill.bench.report import emit
from tokenmill.cli.args import engine_args_from


def _llm(ns: argparse.Namespace):
    from tokenmill.entrypoints.llm import LLM

    return LLM(**dataclasses.asdict(engine_args_from(ns)))


def _params(output_len: int):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)


def run_throughput(ns: argparse.Namespace) -> int:
    apply_workload(ns)
    llm = _llm(ns)
    vocab = int(llm.config.model_config.hf_config.vocab_size)
    reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.prefix_len, ns.dataset_seed, vocab,
                           ns.min_input_len)
    loras = _loras(ns, llm)
    warm = {"prompt_token_ids": reqs[0].prompt_token_ids[:16]}
    llm.generate([warm] * max(1, len(loras)), _params(4), use_tqdm=False, lora_request=loras or None)  # warm-up
    llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    per_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    llm.engine_core.profile.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, _params(ns.output_len), use_tqdm=not ns.disable_tqdm, lora_request=per_request)
    elapsed = time.perf_counter() - t0
    in_toks = sum(len(o.prompt_token_ids) for o in outs)
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    result = dict(
        workload=ns.workload, num_prompts=ns.num_prompts, input_len=ns.input_len + ns.prefix_len,
        output_len=ns.output_len, prefix_len=ns.prefix_len, dtype=llm.config.model_config.dtype,
        enable_prefix_caching=llm.config.cache_config.enable_prefix_caching, elapsed_time=elapsed,
        requests_per_second=len(outs) / elapsed, output_tokens_per_second=out_toks / elapsed,
        total_tokens_per_second=(in_toks + out_toks) / elapsed, total_input_tokens=in_toks,
        total_output_tokens=out_toks, num_preemptions=llm.engine_core.scheduler.num_preemptions,
        prefix_cache_hit_tokens=sum(o.num_cached_tokens for o in outs),
        peak_kv_token_share=llm.engine_core.scheduler.peak_token_share,
        peak_num_running=llm.engine_core.scheduler.peak_num_running,
        kv_cache_dtype=llm.config.cache_config.cache_dtype, kv_cache_blocks=llm.config.cache_config.num_blocks,
        quantization=llm.config.model_config.quantization, num_loras=len(loras))
    if ns.profile:
        result["profile"] = {k: round(v, 3) for k, v in llm.engine_core.profile.seconds.items()}
    emit(result, "Throughput benchmark", ns.output_json)
    if ns.profile:
        print(llm.engine_core.profile.table())
    return 0


def _loras(ns: argparse.Namespace, llm) -> list:
    """The adapters the requests take turns on (--lora-path), each its own id."""
    from tokenmill.lora.request import LoRARequest

    paths = list(getattr(ns, "lora_path", None) or [])
    if len(paths) == 1 and llm.config.lora_config is not None:
        paths *= llm.config.lora_config.max_loras
    return [LoRARequest(f"lora-{i + 1}", i + 1, path) for i, path in enumerate(paths)]


def run_latency(ns: argparse.Namespace) -> int:
    """TTFT = wall time of a 1-token request; TPOT = (time of the full request - TTFT) / (output_len - 1). With
    --batch-size B (vLLM's flag), B distinct prompts run together: TTFT is the batch's prefill, TPOT a step of B."""
    apply_workload(ns)
    ns.enable_prefix_caching = False  # every iteration must recompute its prompt
    if ns.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {ns.batch_size}")
    llm = _llm(ns)
    vocab = int(llm.config.model_config.hf_config.vocab_size)
    prompt = [{"prompt_token_ids": r.prompt_token_ids}
              for r in random_requests(ns.batch_size, ns.input_len, ns.output_len, 0, ns.dataset_seed, vocab)]

    def timed(n_out: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, _params(n_out), use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(ns.num_iters_warmup):
        timed(ns.output_len)
    ttfts = [timed(1) for _ in range(ns.num_iters)]
    totals = [timed(ns.output_len) for _ in range(ns.num_iters)]
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    result = dict(workload=ns.workload, input_len=ns.input_len, output_len=ns.output_len, batch_size=ns.batch_size,
                  dtype=llm.config.model_config.dtype, quantization=llm.config.model_config.quantization,
                  num_iters=ns.num_iters, ttft_ms=ttft * 1000,
                  tpot_ms=(total - ttft) / max(ns.output_len - 1, 1) * 1000, avg_latency_s=statistics.mean(totals),
                  median_latency_s=total)
    emit(result, "Latency benchmark", ns.output_json)
    return 0
