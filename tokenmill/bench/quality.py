"""`tokenmill bench quality`: what each speed trick costs in answer quality, before a user turns it on.

For every mode (bf16, int8, int4 at each group size, gguf blocks, each KV-cache dtype) it measures, through the
engine itself:
- perplexity over a shipped public-domain corpus, from the engine's own prompt logprobs (windows of
  `--window` tokens, each scored from its second token on, prefilled in chunks of `--prefill-chunk` so that
  most tokens attend K/V read back from the cache);
- greedy agreement with the first mode (the unquantized reference) on fixed chat prompts: the share of requests
  whose first `--max-tokens` tokens are identical, and the mean length of the identical start.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
from pathlib import Path

from tokenmill.bench.report import emit
from tokenmill.cli.args import engine_args_from

# The shipped public-domain texts (data/README.md), ~35k SmolLM2 tokens: with fewer (the first file alone, ~3.5k)
# the perplexity of one KV-cache dtype moved by +-1% with nothing but its rounding changed (a scale of 0.9 or 1.1),
# so a 1% cost could not be told from noise.
CORPUS_FILES = tuple(Path(__file__).parent / "data" / name
                     for name in ("quality_corpus.txt", "quality_corpus_kjv.txt"))

# mode name -> the engine settings it changes
MODES = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
    "gguf": {"quantization": "gguf"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "kv-fp8-scaled": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "kv-int8": {"kv_cache_dtype": "int8"},
}

# fixed chat prompts for the greedy agreement (and benchmarks/chats.py)
CHATS = json.loads((Path(__file__).parent / "data" / "chats.json").read_text())


@dataclasses.dataclass
class ModeResult:
    mode: str
    perplexity: float | None = None
    greedy_identical: float | None = None
    mean_identical_start: float | None = None
    linear_weight_mib: float | None = None
    kv_bytes_per_token: int | None = None
    seconds: float | None = None
    dtype: str | None = None
    error: str | None = None


def corpus_windows(tokenizer, window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Each file's tokens cut into windows (none spans two files); max_tokens: only that many, from the start."""
    windows = []
    for path in CORPUS_FILES:
        ids = tokenizer(path.read_text()).input_ids
        windows += [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]
    if max_tokens is not None:
        kept, total = [], 0
        for w in windows:
            if total >= max_tokens:
                break
            kept.append(w[:max_tokens - total])
            total += len(kept[-1])
        windows = [w for w in kept if len(w) >= 2]
    return windows


def perplexity(llm, windows: list[list[int]]) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            total += entry[token].logprob
            count += 1
    return math.exp(-total / count)


def greedy_answers(llm, max_tokens: int) -> list[list[int]]:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(share of answers identical to the reference, mean length of the identical start)."""
    starts = []
    for a, b in zip(ours, ref):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        starts.append(n)
    identical = sum(a == b for a, b in zip(ours, ref)) / len(ref)
    return identical, sum(starts) / len(starts)


def _measure(mode: str, base: dict, ns, ref_answers) -> tuple[ModeResult, list[list[int]] | None]:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.model.loader import linear_weight_bytes

    res = ModeResult(mode)
    t0 = time.perf_counter()
    try:
        llm = LLM(**{**base, **MODES[mode]})
    except ValueError as e:  # a mode this model cannot take (a group size that does not divide, gguf on a folder)
        res.error = str(e).splitlines()[0]
        return res, None
    res.dtype = llm.config.model_config.dtype
    res.linear_weight_mib = linear_weight_bytes(llm.engine_core.executor.runner.model) / 2**20
    res.kv_bytes_per_token = llm.config.cache_config.kv_bytes_per_token(llm.config.model_config)
    res.perplexity = perplexity(llm, corpus_windows(llm.tokenizer, ns.window, ns.max_corpus_tokens))
    answers = greedy_answers(llm, ns.max_tokens)
    if ref_answers is not None:
        res.greedy_identical, res.mean_identical_start = agreement(answers, ref_answers)
    else:
        res.greedy_identical, res.mean_identical_start = 1.0, sum(map(len, answers)) / len(answers)
    res.seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    return res, answers


def format_table(results: list[ModeResult], max_tokens: int) -> str:
    ref = next((r.perplexity for r in results if r.perplexity is not None), None)
    lines = [f"| mode | linear weights (MiB) | KV bytes/token | perplexity | vs {results[0].mode} | "
             f"greedy identical ({max_tokens} tokens) | mean identical start |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.mode} | n/a: {r.error} | | | | | |")
            continue
        delta = f"{(r.perplexity / ref - 1) * 100:+.2f}%" if ref else ""
        lines.append(f"| {r.mode} | {r.linear_weight_mib:.1f} | {r.kv_bytes_per_token} | {r.perplexity:.3f} | "
                     f"{delta} | {r.greedy_identical * 100:.0f}% | {r.mean_identical_start:.1f} |")
    return "\n".join(lines)


def run_quality(ns: argparse.Namespace) -> int:
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    base = dataclasses.asdict(engine_args_from(ns))
    if base.get("kv_cache_memory") is None and base.get("num_gpu_blocks_override") is None:
        base["kv_cache_memory"] = "256MiB"
    # small prefill chunks: all of a window but its first chunk reads K/V back from the (maybe quantized) cache
    base["max_num_batched_tokens"] = ns.prefill_chunk
    results, ref_answers = [], None
    for mode in modes:
        res, answers = _measure(mode, base, ns, ref_answers)
        if ref_answers is None and answers is not None:
            ref_answers = answers
        results.append(res)
        print(f"{mode}: " + (res.error or f"perplexity {res.perplexity:.3f}, greedy identical "
                                            f"{res.greedy_identical * 100:.0f}% ({res.seconds:.1f} s)"), flush=True)
    table = format_table(results, ns.max_tokens)
    dtype = next((r.dtype for r in results if r.dtype), base.get("dtype"))
    emit({"dtype": dtype, "max_tokens": ns.max_tokens, "window": ns.window, "prefill_chunk": ns.prefill_chunk,
          "results": [dataclasses.asdict(r) for r in results]}, "Quality benchmark", ns.output_json)
    print(f"(activations and unquantized weights in {dtype}; the first mode is the reference)")
    print(table)
    return 0


def add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="bf16,int8,int4-g32,int4-g64,int4-g128,gguf,kv-fp8,kv-fp8-scaled,kv-fp8_e5m2,"
                                      "kv-int8",
                   help=f"Comma-separated modes, the first being the reference; from: {', '.join(MODES)}.")
    p.add_argument("--max-tokens", type=int, default=64, help="Greedy tokens per chat prompt.")
    p.add_argument("--window", type=int, default=1024, help="Tokens per perplexity window.")
    p.add_argument("--max-corpus-tokens", type=int, default=None,
                   help="Score only the corpus's first N tokens (default: all ~35k; fewer resolve less).")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="Token budget of a step here (it overrides --max-num-batched-tokens): prompts go in chunks "
                        "of this size, so all but a window's first chunk attend K/V read back from the cache, "
                        "as decoding does, and a KV-cache dtype's cost shows in the perplexity.")
    p.add_argument("--output-json", default=None, help="Save the results here as JSON.")
