"""`tokenmill plan [MODEL]`: the memory and speed a model needs on a device, and the replicas and cost a target
rate implies, printed or as JSON (`--json`)."""

from __future__ import annotations

import argparse
import json

from tokenmill.utils import format_bytes


def add_plan_parser(sub) -> None:
    from tokenmill.plan.devices import PROFILES

    p = sub.add_parser("plan", help="Predict a model's memory, speed, replicas and cost on this machine or a "
                                    "device profile, from its config alone (no weights loaded).")
    p.add_argument("model", nargs="?", default=None, help="A Hugging Face folder or .gguf file (default: the "
                                                          "embedded SmolLM2).")
    p.add_argument("--device", default="this", help=f"this (probe this machine, ~10 s) or a profile: "
                                                    f"{', '.join(PROFILES)}.")
    p.add_argument("--dtype", default="auto", help="Model dtype, as `serve --dtype` (auto: bfloat16 here).")
    p.add_argument("--quantization", "-q", choices=["int8", "int4"], default=None, help="Weight-only format.")
    p.add_argument("--quantization-group-size", type=int, default=32)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget like 4GiB (default: serve's own on a CPU, 90%% of a GPU less weights).")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="Prompt tokens of a request (W2: 128).")
    p.add_argument("--output-len", type=int, default=256, help="Output tokens of a request (W2: 256).")
    p.add_argument("--batch-size", type=int, default=16, help="The batch of the batched TPOT figure.")
    p.add_argument("--context-len", type=int, default=None,
                   help="Tokens per request for max concurrency (default: input + output).")
    p.add_argument("--max-num-seqs", type=int, default=256, help="The most requests a replica runs at once.")
    p.add_argument("--request-rate", type=float, default=None, help="Requests/s the fleet must take: how many "
                                                                    "replicas.")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="Largest TPOT a replica may run at.")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="Largest TTFT a replica may run at.")
    p.add_argument("--price-per-hour", type=float, default=None, help="One replica's price: cost per 1M tokens.")
    p.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    p.set_defaults(func=run_plan)


def build_plan(ns: argparse.Namespace):
    from tokenmill.model.model_config import load_hf_config, resolve_dtype
    from tokenmill.model.source import resolve_model
    from tokenmill.plan.devices import get_profile
    from tokenmill.plan.model_shape import ModelShape
    from tokenmill.plan.roofline import Workload, make_plan
    from tokenmill.utils import parse_bytes

    source = resolve_model(ns.model)
    hf = load_hf_config(source.path, source.format)
    shape = ModelShape.from_hf_config(hf)
    device = get_profile(ns.device, shape, ns.quantization, ns.quantization_group_size)
    dtype = resolve_dtype(ns.dtype, hf, "cuda" if device.kind == "cuda" else "cpu")
    workload = Workload(ns.input_len, ns.output_len, ns.batch_size, ns.context_len, ns.request_rate,
                        ns.tpot_slo_ms, ns.ttft_slo_ms, ns.price_per_hour, ns.max_num_seqs)
    budget = parse_bytes(ns.kv_cache_memory, "kv_cache_memory") if ns.kv_cache_memory else None
    return make_plan(source.name, shape, device, dtype, ns.quantization, workload,
                     ns.block_size, budget, ns.quantization_group_size, ns.kv_cache_dtype), device


def describe(plan, device) -> str:
    p, c = plan.predicted, plan.capacity
    lines = [
        f"{plan.model} on {device.name} ({device.note or device.kind}), {plan.dtype}"
        f"{', weights ' + plan.quantization if plan.quantization else ''}",
        f"  weights           {format_bytes(plan.weights_bytes)} ({format_bytes(plan.decode_weight_bytes)} "
        f"streamed per decode step)",
        f"  KV cache          {plan.kv_bytes_per_token} bytes a token; {format_bytes(plan.kv_cache_bytes)} = "
        f"{plan.num_kv_blocks} blocks",
        f"  max concurrency   {plan.max_concurrency} requests of {plan.context_len} tokens",
        f"  TTFT              {p['ttft_ms']:.1f} ms alone; {p['ttft_ms_batch']:.0f} ms for {p['batch_size']} "
        f"prompts at once",
        f"  TPOT              {p['tpot_ms_batch1']:.2f} ms at batch 1; {p['tpot_ms_batch']:.2f} ms at batch "
        f"{p['batch_size']} ({p['output_tokens_per_s_batch']:.0f} output tokens/s)"]
    if not c["meets_slo"]:
        lines.append(f"  capacity          {c['reason']}")
        return "\n".join(lines)
    lines.append(f"  one replica       {c['requests_per_s_per_replica']:.2f} requests/s at batch {c['batch_size']} "
                 f"(TPOT {c['tpot_ms']:.1f} ms, TTFT {c['ttft_ms']:.0f} ms), "
                 f"{c['output_tokens_per_s_per_replica']:.0f} output tokens/s")
    if "replicas" in c:
        lines.append(f"  replicas          {c['replicas']}")
    if "cost_per_1m_output_tokens" in c:
        lines.append(f"  cost              {c['cost_per_1m_output_tokens']:.2f} per 1M output tokens")
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace) -> int:
    plan, device = build_plan(ns)
    if ns.json:
        print(json.dumps({**plan.to_dict(), "device_profile": {
            "bandwidth_gbs": device.bandwidth_gbs, "bf16_tflops": device.bf16_tflops,
            "memory_bytes": device.memory_bytes, "note": device.note}}, indent=2))
    else:
        print(describe(plan, device))
    return 0
