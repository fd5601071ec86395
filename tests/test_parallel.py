"""Tensor, pipeline and expert parallel give the same greedy output as one process (fp32, ties detected
explicitly, as in test_model_vs_hf), over spawned ranks and over a local Ray cluster; bad layouts fail at start
naming the flag; a rank that dies ends the engine with an error instead of a hang.

The references are transformers' greedy tokens and logits: one process matches them (test_model_vs_hf), so a
parallel engine that matches them matches one process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_greedy_matches, hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.create_config import create_engine_config

NEW_TOKENS = 16
TEXTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "1, 2, 3, 5, 8, 13,"]


def _check_against(ref_model, llm: LLM, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        logprobs = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
        ref, ref_logits = hf_greedy(ref_model, prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


# ---- bad layouts: clear errors at start, no processes started ----------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size 2 does not divide the model's 9 attention heads"),
    (dict(pipeline_parallel_size=31), "pipeline_parallel_size 31 is larger than the model's 30 layers"),
    (dict(enable_expert_parallel=True), "enable_expert_parallel: the model has no experts"),
    (dict(tensor_parallel_size=0), "must be at least 1"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding does not run with tensor or pipeline parallel"),
])
def test_bad_layout_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(EngineArgs(**kwargs))


def test_expert_parallel_must_divide_the_experts():
    from types import SimpleNamespace

    from tokenmill.config import ParallelConfig

    moe = SimpleNamespace(num_attention_heads=8, num_key_value_heads=8, num_local_experts=6, intermediate_size=64,
                          num_hidden_layers=4)
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).validate(moe)
    with pytest.raises(ValueError, match="enable_expert_parallel: tensor_parallel_size 4 does not divide the "
                                         "model's 6 experts"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).validate(moe)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 and the model's 3 KV heads: one must divide"):
        ParallelConfig(tensor_parallel_size=8).validate(SimpleNamespace(**{**vars(moe), "num_key_value_heads": 3}))


# ---- real weights: the embedded SmolLM2, and a copy padded to 16 query / 4 KV heads -------------------------------
@pytest.fixture(scope="module")
def padded_smollm2(tmp_path_factory):
    from tokenmill.model.pad_heads import write_padded_model

    folder = write_padded_model(tmp_path_factory.mktemp("smollm2-padded"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def padded_reference(padded_smollm2):
    return _hf(padded_smollm2)


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    return [smol_tokenizer(t).input_ids for t in TEXTS]


@pytest.mark.slow
def test_padded_copy_computes_what_the_original_does(smol_llm, padded_reference, prompts):
    """The precondition of the tensor-parallel test on real weights: the original model, in one process, agrees
    with transformers running the padded copy."""
    _check_against(padded_reference, smol_llm, prompts)


@pytest.mark.slow
def test_tensor_parallel_2_on_real_weights(padded_smollm2, padded_reference, prompts):
    with LLM(str(padded_smollm2), dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=2) as llm:
        _check_against(padded_reference, llm, prompts)


@pytest.mark.slow
def test_pipeline_parallel_2_on_the_embedded_model(padded_reference, prompts):
    """PP needs no padding: the 30 layers split 15 + 15 (the padded reference computes the original's outputs)."""
    with LLM(dtype="float32", kv_cache_memory="64MiB", pipeline_parallel_size=2) as llm:
        _check_against(padded_reference, llm, prompts)


# ---- mixtures of experts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, kwargs", [
    pytest.param("qwen2_moe", dict(tensor_parallel_size=2), marks=pytest.mark.slow),    # every expert split in two
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True)),             # two whole experts a rank
    pytest.param("qwen3_moe", dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
                 marks=pytest.mark.slow),
])
def test_mixture_of_experts_parallel(tiny_model_dir, family, kwargs):
    folder = tiny_model_dir(family)
    prompts = [[101, 2000, 3000, 4000, 5000], list(range(200, 240)), list(range(1000, 1071))]
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", **kwargs) as llm:
        _check_against(_hf(folder), llm, prompts)


# ---- Ray, and a rank that dies ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensor_parallel_over_a_local_ray_cluster(tiny_model_dir, monkeypatch):
    pytest.importorskip("ray")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="distributed_executor_backend ray: no Ray cluster is reachable"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=2,
            distributed_executor_backend="ray")
    subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True)
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        folder = tiny_model_dir("llama")
        with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=2,
                 distributed_executor_backend="ray") as llm:
            _check_against(_hf(folder), llm, [[101, 2000, 3000, 4000, 5000], list(range(200, 240))])
        ray.shutdown()
        _router_replicas_over_ray(folder)
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True)


def _router_replicas_over_ray(folder) -> None:
    """`router --replicas 2 --distributed-executor-backend ray` (same cluster): Ray starts both replicas, each on a
    core of its node; both join the rotation and answer; stopping the router stops them."""
    import requests
    from server_utils import ServerProcess, free_port

    router = ServerProcess("--host", "127.0.0.1", "--model", str(folder), "--health-interval", "0.3",
                           "--replicas", "2", "--distributed-executor-backend", "ray", "--replica-port-base",
                           str(free_port()), "--replica-args", f"{folder} --dtype float32 --kv-cache-memory 16MiB",
                           command="router")
    try:
        deadline = time.time() + 120
        while True:
            backends = requests.get(router.url + "/router/backends").json()["backends"]
            if sum(b["healthy"] for b in backends) == 2:
                break
            assert time.time() < deadline, backends
            time.sleep(0.5)
        for i in range(4):
            r = requests.post(router.url + "/v1/completions", json={"prompt": [100 + i] * 20, "max_tokens": 4})
            assert r.status_code == 200
        urls = [b["url"] for b in backends]
    finally:
        router.stop()
    for url in urls:   # the actors stopped their servers
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)


@pytest.mark.slow
def test_a_dead_rank_fails_the_server_instead_of_hanging(tiny_model_dir):
    """SIGKILL on rank 1 mid-stream: the in-flight request gets an error event, /health stops answering 200 and
    the server exits non-zero."""
    import requests
    from server_utils import ServerProcess, kill_mid_stream

    s = ServerProcess(str(tiny_model_dir("llama")), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                      "--tensor-parallel-size", "2")
    try:
        ok = requests.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

        def rank_1() -> int:
            ranks = subprocess.run(["pgrep", "-P", str(s.engine_pid())], capture_output=True, text=True).stdout
            assert ranks.split(), "the engine core has no rank process"
            return int(ranks.split()[0])

        codes, exit_code, errors = kill_mid_stream(s, rank_1, max_tokens=900)
        assert codes and codes[-1] != 200, "health kept answering 200 with a rank dead"
        assert exit_code != 0 and errors
    finally:
        s.stop()
