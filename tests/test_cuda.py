"""The engine on an NVIDIA GPU: the model, the KV cache, attention (torch_sdpa), the sampler and the proposers run
there, transformers runs on the CPU, both in fp32, so the CPU's rule holds: token for token, ties detected
explicitly. Marked `cuda`: `make test` deselects them; on a machine with a GPU run
`pytest -m cuda tests/test_cuda.py` (benchmarks/cuda/check.sh does it on a bare one)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY_FAMILIES, assert_greedy_matches, hf_greedy

from tokenmill import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU that torch sees")]

NEW_TOKENS = 24


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _on_gpu(llm: LLM) -> LLM:
    """The engine really runs there: the runner's device, its weights and its KV cache (a test of a CPU run that
    slipped through would otherwise pass)."""
    runner = llm.engine_core.executor.runner
    assert runner.device == "cuda"
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert runner.kv_caches and all(c.is_cuda for c in runner.kv_caches)
    return llm


def _greedy(llm: LLM, prompts, n=NEW_TOKENS):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _assert_matches_hf(hf, prompts, ours, n=NEW_TOKENS):
    for prompt, (tokens, logprobs) in zip(prompts, ours):
        ref, ref_logits = hf_greedy(hf, prompt, n)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_family_on_the_gpu_matches_transformers(family, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(family)
    prompts = _prompts([3, 17, 40, 71])
    llm = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", block_size=16))
    ours = _greedy(llm, prompts)
    _assert_matches_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts, ours)


def test_reference_backend_on_the_gpu_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("qwen2_window")
    prompts = _prompts([5, 33, 60])
    llm = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", attention_backend="torch_ref"))
    ours = _greedy(llm, prompts)
    _assert_matches_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts, ours)


def test_chunks_prefix_cache_and_preemption_on_the_gpu(tiny_model_dir):
    """Prompts sharing a prefix, cut into 16-token chunks, in too few blocks for all of them at once: cached blocks,
    chunked prompts and recomputed (preempted) requests all read the GPU's paged cache."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    shared = _prompts([48], seed=7)[0]
    prompts = [shared + tail for tail in _prompts([5, 20, 9, 31], seed=8)]
    llm = _on_gpu(LLM(str(folder), dtype="float32", num_gpu_blocks_override=14, block_size=16,
                      max_num_batched_tokens=16, enable_prefix_caching=True))
    ours = _greedy(llm, prompts, 40)
    assert llm.engine_core.scheduler.num_preemptions >= 1
    _assert_matches_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts, ours, 40)


@pytest.mark.parametrize("family,method", [("llama", "int4"), ("qwen2", "int8")])
def test_quantized_weights_on_the_gpu_match_the_dequantized_model(family, method, tiny_model_dir):
    from test_quantization import _quantize_hf_model
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(family)
    prompts = _prompts([4, 41])
    llm = _on_gpu(LLM(str(folder), dtype="float32", quantization=method, kv_cache_memory="32MiB"))
    from tokenmill.layers.quant.kernel import QuantLinearKernel

    kernels = [v for m in llm.engine_core.executor.runner.model.modules() for v in vars(m).values()
               if isinstance(v, QuantLinearKernel)]
    assert kernels and all(k.gpu is not None and k.weight is None for k in kernels)   # kept quantized on the GPU
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _quantize_hf_model(hf, method, 32)
    _assert_matches_hf(hf, prompts, _greedy(llm, prompts))


def test_decode_steps_replay_cuda_graphs_on_the_triton_backend(tiny_model_dir):
    """The GPU's default engine: Triton decode attention, decode steps from CUDA graphs (five rows replay the
    size 8, padded), token for token with transformers; --enforce-eager runs without graphs."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    prompts = _prompts([3, 17, 40, 71, 5])
    llm = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB"))
    runner = llm.engine_core.executor.runner
    assert runner.model.attention_layers()[0].backend.name == "triton" and runner.graphs is not None
    ours = _greedy(llm, prompts)
    assert runner.graphs.replays > 0
    _assert_matches_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts, ours)
    eager = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enforce_eager=True))
    assert eager.engine_core.executor.runner.graphs is None


def test_ngram_speculation_on_the_gpu_is_lossless(tiny_model_dir):
    """Repetitive prompts, so the n-gram proposer drafts and the rejection sampler verifies on the GPU."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("qwen3")
    base = _prompts([6, 9], seed=3)
    prompts = [p * 6 for p in base]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", speculative_config=spec))
    _assert_matches_hf(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts,
                       _greedy(llm, prompts, 32), 32)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_on_the_gpu_reads_as_the_cpu_reference(kv):
    """write_kv and the torch_sdpa backend on GPU tensors give what torch_ref gives on the CPU from the same
    quantized cache (the bytes copied back), for decode rows and a prompt row after cached context."""
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.ops import KV_CACHE_DTYPES, write_kv
    from tokenmill.attention.torch_ref import TorchRefBackend
    from tokenmill.attention.torch_sdpa import TorchSdpaBackend

    torch.manual_seed(0)
    hq, hkv, d, bs, blocks = 8, 2, 32, 16, 12
    seq_lens, q_lens = [37, 5, 20], [1, 1, 8]
    cache = torch.zeros(2, blocks, bs, hkv, d, dtype=KV_CACHE_DTYPES[kv][0], device="cuda")
    table = torch.tensor([[1, 2, 3], [4, 0, 0], [7, 5, 0]], dtype=torch.int32)
    slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for r, n in enumerate(seq_lens) for p in range(n)])
    k, v = torch.randn(len(slots), hkv, d, device="cuda"), torch.randn(len(slots), hkv, d, device="cuda")
    write_kv(cache, k, v, slots.cuda(), 0.05, 0.04)
    new = [sum(seq_lens[:r]) + seq_lens[r] - q_lens[r] + i for r in range(3) for i in range(q_lens[r])]
    q = torch.randn(len(new), hq, d, device="cuda")
    qsl = torch.tensor([0, 1, 2, 10])
    md = AttentionMetadata(slots[new], table, qsl, torch.tensor(seq_lens), qsl.numpy(),
                           torch.tensor(seq_lens).numpy(), max(q_lens), max(seq_lens))
    ours = TorchSdpaBackend().forward(q, k[new], v[new], cache, md.to("cuda"), d**-0.5, 0.05, 0.04)
    ref = TorchRefBackend().forward(q.cpu(), k[new].cpu(), v[new].cpu(), cache.cpu(), md, d**-0.5, 0.05, 0.04)
    torch.testing.assert_close(ours.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_fp8_cache_on_the_gpu_holds_twice_the_blocks_and_generates(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    auto = _on_gpu(LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB"))
    fp8 = _on_gpu(LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB", kv_cache_dtype="fp8"))
    assert fp8.config.cache_config.num_blocks == 2 * auto.config.cache_config.num_blocks
    assert fp8.engine_core.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    out = _greedy(fp8, _prompts([30, 50]), 16)
    assert all(len(t) == 16 and all(lp <= 0 for lp in lps) for t, lps in out)


def test_sampling_on_the_gpu(tiny_model_dir):
    """Seeds repeat on the GPU's generators; top_k=1 is greedy; a strong logit bias wins every step; min_tokens
    holds back a stop token; top-p, min-p and penalties run."""
    llm = _on_gpu(LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB"))
    prompt = [{"prompt_token_ids": _prompts([12])[0]}]

    def run(**kw):
        return llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, **kw), use_tqdm=False)[0] \
            .outputs[0].token_ids

    seeded = dict(temperature=1.0, top_p=0.9, seed=11)
    assert run(**seeded) == run(**seeded)
    assert run(temperature=1.0, top_k=1, seed=5) == run(temperature=0)
    assert run(temperature=0.8, logit_bias={777: 100.0}) == [777] * 16
    assert len(run(temperature=0.7, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, seed=2)) == 16
    greedy = run(temperature=0)
    stop = greedy[2]
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop], min_tokens=6),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert stop not in out[:6] and len(out) >= 6


def test_json_schema_on_the_gpu(tiny_model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "with-eos")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))   # a grammar ends at EOS
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    llm = _on_gpu(LLM(str(folder), dtype="float32", kv_cache_memory="32MiB"))
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=64, structured_outputs={"json": schema})
    out = llm.generate([{"prompt_token_ids": p} for p in _prompts([8, 30])], sp, use_tqdm=False)
    for o in out:
        assert json.loads(o.outputs[0].text)["answer"] in ("yes", "no")


def test_embeddings_on_the_gpu_equal_transformers_pooling(tiny_model_dir):
    from transformers import AutoModel

    folder = tiny_model_dir("llama")
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32)
    prompts = _prompts([3, 40])
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", pooler="mean", max_num_batched_tokens=24) as llm:
        _on_gpu(llm)
        embs = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    for ids, emb in zip(prompts, embs):
        with torch.no_grad():
            ref = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0)
        assert torch.nn.functional.cosine_similarity(torch.tensor(emb), ref, dim=0) >= 0.9999


def test_server_on_the_gpu_streams_a_completion(tiny_model_dir):
    import requests
    from server_utils import ServerProcess

    server = ServerProcess(str(tiny_model_dir("llama")), "--dtype", "bfloat16", "--kv-cache-memory", "64MiB")
    try:
        body = {"prompt": "The sea", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        chunks = []
        with requests.post(server.url + "/v1/completions", json={**body, "stream": True}, stream=True,
                           timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == r.json()["choices"][0]["text"]
    finally:
        server.stop()
