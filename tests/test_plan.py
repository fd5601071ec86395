"""`tokenmill plan`: its sizes against what the engine really allocates (the kernels' weight bytes, KV bytes per
token, blocks in a budget), its flops against the team's figures for SmolLM2, the roofline's capacity and cost
arithmetic on a made-up device, and the command's text and JSON. (Its speed predictions are checked against
`tokenmill bench latency` in benchmarks/, never here.)"""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.plan.devices import DeviceProfile, Efficiency, get_profile
from tokenmill.plan.model_shape import ModelShape, decode_weight_bytes
from tokenmill.plan.roofline import Roofline, Workload, make_plan


@pytest.mark.parametrize("family, quantization", [("llama", None), ("llama", "int8"), ("llama_linear", "int4")])
def test_the_plans_sizes_are_what_the_engine_allocates(tiny_model_dir, family, quantization):
    """Weight bytes as the kernels keep them (bf16 packed, int8 with per-channel scales, int4 groups with an int8
    lm head, a tied head), KV bytes per token, and the blocks a 16 MiB budget holds."""
    from tokenmill import LLM
    from tokenmill.model.loader import linear_weight_bytes
    from tokenmill.model.model_config import load_hf_config

    folder = str(tiny_model_dir(family))
    llm = LLM(folder, dtype="bfloat16", quantization=quantization, kv_cache_memory="16MiB")
    shape = ModelShape.from_hf_config(load_hf_config(folder, "hf"))
    plan = make_plan("tiny", shape, get_profile("epyc-zen5-2core"), "bfloat16", quantization, Workload(),
                     kv_cache_memory=16 << 20)
    assert plan.decode_weight_bytes == linear_weight_bytes(llm.engine_core.executor.runner.model)
    assert plan.kv_bytes_per_token == llm.config.model_config.kv_bytes_per_token()
    assert plan.num_kv_blocks == llm.config.cache_config.num_blocks
    assert plan.max_concurrency == plan.num_kv_blocks // math.ceil((128 + 256) / 16)


SMOL = ModelShape(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                  vocab_size=49152, tied_embeddings=True)


def test_smollm2s_flops_and_bytes_are_the_teams_figures():
    """../shared/workloads.md: ~212 MFLOP per prompt token, ~270 per output token; 134.5M matmul weights."""
    assert round(SMOL.linear_params() / 1e6, 1) == 106.2
    assert round(SMOL.flops_per_decoded_token(0) / 1e6) == 269
    assert round((SMOL.prefill_flops(1) - 2 * SMOL.lm_head_params()) / 1e6) == 212
    assert decode_weight_bytes(SMOL, "bfloat16", None) == 2 * (SMOL.linear_params() + SMOL.lm_head_params())
    assert SMOL.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2
    assert SMOL.kv_bytes_per_token("bfloat16", "fp8") == 2 * 30 * 3 * 64


def _device(**eff) -> DeviceProfile:
    """100 GB/s and 1 TFLOP/s at full efficiency, 1 ms a step: numbers to check the arithmetic by hand."""
    return DeviceProfile("made-up", "cpu", 64 << 30, 100.0, 1.0, 2.0,
                         Efficiency(bandwidth=1.0, decode_flops={"none": 1.0}, prefill_flops={"none": 1.0},
                                    step_overhead_ms=1.0, **eff))


def test_the_roofline_is_the_slower_of_bytes_and_flops_plus_the_step_cost():
    roof = Roofline(SMOL, _device(), "bfloat16", None)
    weights_ms = roof.weight_bytes / 100e9 * 1000                 # ~2.7 ms: bandwidth-bound at batch 1
    assert roof.tpot(1, 0) * 1000 == pytest.approx(1.0 + weights_ms)
    compute_ms = 64 * SMOL.flops_per_decoded_token(0) / 1e12 * 1000   # ~17 ms: compute-bound at batch 64
    assert roof.tpot(64, 0) * 1000 == pytest.approx(1.0 + compute_ms)
    kv_ms = 64 * 1000 * SMOL.kv_bytes_per_token("bfloat16") / 100e9 * 1000
    attention_ms = 64 * 4 * 30 * 9 * 64 * 1000 / 1e12 * 1000
    assert roof.tpot(64, 1000) * 1000 == pytest.approx(1.0 + compute_ms + kv_ms + attention_ms)
    # a prompt: the body's flops (compute-bound at 100 rows), and the head streamed once for the one sampled row
    head_ms = 2 * SMOL.lm_head_params() / 100e9 * 1000
    body_ms = (SMOL.prefill_flops(100) - 2 * SMOL.lm_head_params()) / 1e12 * 1000
    assert roof.ttft(100) * 1000 == pytest.approx(1.0 + body_ms + head_ms)


def test_measured_kernel_times_replace_the_roofline_and_interpolate_between_probes():
    device = DeviceProfile("probed", "cpu", 64 << 30, 100.0, 1.0, 2.0, Efficiency(step_overhead_ms=0.0),
                           {1: 1e-11, 16: 2e-11, 256: 16e-11})
    roof = Roofline(SMOL, device, "bfloat16", None)
    assert roof.tpot(1, 0) == pytest.approx(roof.weight_bytes * 1e-11)
    assert roof.tpot(8, 0) == pytest.approx(roof.weight_bytes * (1e-11 + 7 / 15 * 1e-11))
    assert roof.tpot(512, 0) == pytest.approx(roof.weight_bytes * 32e-11)   # linear in rows past the largest
    # a step's own cost: fixed per format, and per row past the first
    costly = DeviceProfile("probed", "cpu", 64 << 30, 100.0, 1.0, 2.0,
                           Efficiency(step_overhead_ms=2.0, format_step_ms={"int8": 1.0},
                                      row_ms={"none": 0.5, "int8": 0.25}), {1: 1e-11, 16: 2e-11, 256: 16e-11})
    bf16, int8 = Roofline(SMOL, costly, "bfloat16", None), Roofline(SMOL, costly, "bfloat16", "int8")
    assert bf16.tpot(8, 0) - roof.tpot(8, 0) == pytest.approx(0.002 + 7 * 0.0005)
    assert int8.tpot(8, 0) - int8.linear_time(8, int8.weight_bytes, 0, 1) == pytest.approx(0.001 + 7 * 0.00025)


def test_replicas_and_cost_follow_from_the_best_batch_within_the_slo():
    loose = make_plan("smol", SMOL, _device(), "bfloat16", None, Workload(request_rate=50, price_per_hour=3.6))
    c = loose.capacity
    tpot, ttft = c["tpot_ms"] / 1000, c["ttft_ms"] / 1000
    assert c["requests_per_s_per_replica"] == pytest.approx(c["batch_size"] / (ttft + 256 * tpot))
    assert c["replicas"] == math.ceil(50 / c["requests_per_s_per_replica"])
    # $3.60 an hour is $0.001 a second: a million output tokens take 1e6 / (tokens/s) seconds
    assert c["cost_per_1m_output_tokens"] == pytest.approx(0.001 * 1e6 / c["output_tokens_per_s_per_replica"])
    tight = make_plan("smol", SMOL, _device(), "bfloat16", None, Workload(request_rate=50, tpot_slo_ms=5)).capacity
    assert tight["tpot_ms"] <= 5 and tight["batch_size"] < c["batch_size"] and tight["replicas"] >= c["replicas"]
    hopeless = make_plan("smol", SMOL, _device(), "bfloat16", None, Workload(tpot_slo_ms=0.5)).capacity
    assert not hopeless["meets_slo"]


def test_a_gpu_profile_sizes_the_cache_from_its_memory_less_the_weights():
    plan = make_plan("smol", SMOL, get_profile("h100"), "bfloat16", None, Workload(context_len=4096))
    assert plan.kv_cache_bytes <= int(80 * 2**30 * 0.9) - plan.weights_bytes - 2**30
    assert plan.kv_cache_bytes > int(80 * 2**30 * 0.9) - plan.weights_bytes - 2**30 - 16 * plan.kv_bytes_per_token
    assert plan.max_concurrency == plan.num_kv_blocks // 256


@pytest.mark.parametrize("argv, flag", [(["--input-len", "0"], "--input-len"), (["--device", "tpu9"], "--device"),
                                        (["--request-rate", "-1"], "--request-rate")])
def test_bad_plan_flags_are_errors_naming_the_flag(capsys, argv, flag):
    from tokenmill.cli.main import main

    assert main(["plan", "--device", "h100", *argv]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_prints_a_plan_and_the_same_as_json(capsys):
    """`--device this` probes this machine's kernels (about ten seconds): the JSON carries the issue's fields."""
    from tokenmill.cli.main import main

    assert main(["plan", "--json", "-q", "int8", "--request-rate", "4", "--price-per-hour", "0.5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {"weights_bytes", "kv_bytes_per_token", "max_concurrency", "predicted", "capacity"} <= set(plan)
    assert {"ttft_ms", "tpot_ms_batch1", "tpot_ms_batch"} <= set(plan["predicted"])
    assert plan["predicted"]["tpot_ms_batch1"] > 0 and plan["capacity"]["replicas"] >= 1
    assert plan["decode_weight_bytes"] == decode_weight_bytes(SMOL, "bfloat16", "int8")
    assert main(["plan", "--device", "h200"]) == 0
    text = capsys.readouterr().out
    assert "max concurrency" in text and "TPOT" in text and "h200" in text
