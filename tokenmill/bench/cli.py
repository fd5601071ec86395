"""The `tokenmill bench` sub-commands."""

from __future__ import annotations

import argparse

from tokenmill.bench.datasets import WORKLOADS
from tokenmill.cli.args import add_engine_args


def _dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="A standard workload of shared/workloads.md; explicit flags below override it.")
    p.add_argument("--dataset", choices=["random"], default="random", help="Random token-id prompts from a seed.")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="Tokens per prompt (after the shared prefix).")
    p.add_argument("--min-input-len", type=int, default=None,
                   help="With it, prompt lengths are drawn uniformly from --min-input-len..--input-len (W5).")
    p.add_argument("--output-len", type=int, default=None, help="Tokens generated per request (forced).")
    p.add_argument("--prefix-len", type=int, default=None, help="A prefix shared by every prompt (W3).")
    p.add_argument("--dataset-seed", type=int, default=None, help="Seed of the random prompts.")
    p.add_argument("--output-json", default=None, help="Save the results here as JSON.")


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="Benchmarks: throughput, latency, quality, spec (offline); serve (a server).")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    from tokenmill.bench.offline import run_latency, run_throughput

    tp = bsub.add_parser("throughput", help="Offline throughput: all requests at once.")
    _dataset_args(tp)
    tp.add_argument("--disable-tqdm", action="store_true")
    tp.add_argument("--lora-path", nargs="+", default=None, metavar="PATH",
                    help="LoRA adapter folders (needs --enable-lora): request i runs adapter i mod N; one folder "
                         "with --max-loras N stands for N adapters (as vLLM's benchmark does).")
    tp.add_argument("--profile", action="store_true",
                    help="Split each step into scheduling, input preparation, forward, sampling, output processing.")
    add_engine_args(tp, positional_model=False)
    tp.set_defaults(func=run_throughput)

    lat = bsub.add_parser("latency", help="Single-request latency: TTFT and TPOT.")
    _dataset_args(lat)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--batch-size", type=int, default=1, help="Prompts run together (each TPOT is a step of all).")
    add_engine_args(lat, positional_model=False)
    lat.set_defaults(func=run_latency)

    from tokenmill.bench.quality import add_quality_args, run_quality

    qa = bsub.add_parser("quality", help="What each quantization costs: perplexity on a shipped corpus and greedy "
                                         "agreement with the unquantized model, one table for every mode.")
    add_quality_args(qa)
    add_engine_args(qa, positional_model=False)
    qa.set_defaults(func=run_quality)

    from tokenmill.bench.spec import add_spec_args, run_spec_bench

    sp = bsub.add_parser("spec", help="Speculative decoding on against off, side by side: TPOT, acceptance, and "
                                      "whether the outputs are identical (W7, W2).")
    add_spec_args(sp)
    sp.set_defaults(func=run_spec_bench)

    from tokenmill.bench.serve import add_serve_bench_args, run_serve_bench

    sv = bsub.add_parser("serve", help="Load-test any OpenAI-compatible server with streaming requests.")
    add_serve_bench_args(sv)
    sv.set_defaults(func=run_serve_bench)

    from tokenmill.bench.transcribe import add_transcribe_bench_args, run_transcribe_bench

    tr = bsub.add_parser("transcribe", help="Speech: espeak-ng clips through /v1/audio/transcriptions, word error "
                                            "rate against the texts and faster-whisper, wall time of concurrent "
                                            "uploads against faster-whisper one clip after another.")
    add_transcribe_bench_args(tr)
    tr.set_defaults(func=run_transcribe_bench)
