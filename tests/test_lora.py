"""Multi-LoRA: adapters made here with peft (random non-zero A and B, fixed seeds) give, through tokenmill, the
greedy output of peft's merged model in transformers (fp32, ties detected as everywhere); a batch mixing three
adapters and the base model, with prompts arriving in chunks, gives each request what it gets alone; adapters
never share prefix-cache blocks; misfit adapters are refused naming what does not fit."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_greedy_matches, hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

NEW_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, target modules, use_rslora)
ADAPTERS = {"all8": (1, 8, ALL, False), "qv4": (2, 4, ["q_proj", "v_proj"], False),
            "mlp8": (3, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], True)}


def make_adapter(load_base, folder, seed: int, rank: int, modules: list[str], rslora: bool = False, std=0.3):
    """A PEFT adapter folder with random A and B; returns transformers' model with it merged in."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_base(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                   use_rslora=rslora, init_lora_weights=False))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, std)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _greedy(llm, prompts, loras):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    """The tiny Llama, its three adapters as LoRARequests, and the reference model of each (None: the base)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")

    def load_base():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    root = tmp_path_factory.mktemp("lora")
    loras, refs = {}, {None: load_base().eval()}
    for i, (name, (seed, rank, modules, rslora)) in enumerate(ADAPTERS.items()):
        loras[name] = LoRARequest(name, i + 1, str(root / name))
        refs[name] = make_adapter(load_base, root / name, seed, rank, modules, rslora)
    return folder, loras, refs


def _check_against_peft(ours, prompts, names, refs):
    for prompt, name, (tokens, logprobs) in zip(prompts, names, ours):
        ref, ref_logits = hf_greedy(refs[name], prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


def test_each_adapter_equals_peft_merged_model(tiny_adapters):
    folder, loras, refs = tiny_adapters
    prompts = _prompts([5, 37])
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=1,
             max_lora_rank=8) as llm:
        outputs = {}
        for name in [*ADAPTERS, None]:
            outputs[name] = _greedy(llm, prompts, loras.get(name))
            _check_against_peft(outputs[name], prompts, [name] * 2, refs)
    # the adapters change the answer (a layer that ignored them would fail above, unless they did nothing)
    assert all(outputs[name][0][0] != outputs[None][0][0] for name in ADAPTERS)


@pytest.mark.parametrize("max_loras", [3, 1])
def test_mixed_batch_equals_each_alone(tiny_adapters, max_loras):
    """Three adapters and the base model in one batch (two prompts each, some in 24-token chunks): with 3 slots
    they share steps; with 1 the scheduler runs one adapter at a time beside the base requests. Either way every
    request gets what transformers gives its own merged model, and what it gets alone."""
    folder, loras, refs = tiny_adapters
    names = [*ADAPTERS, None] * 2
    prompts = _prompts([3, 17, 40, 71, 9, 30, 52, 6], seed=1)
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=max_loras,
             max_lora_rank=8, max_num_batched_tokens=24) as llm:
        mixed = _greedy(llm, prompts, [loras.get(n) for n in names])
        alone = [_greedy(llm, [p], loras.get(n))[0] for p, n in zip(prompts, names)]
    _check_against_peft(mixed, prompts, names, refs)
    _check_against_peft(alone, prompts, names, refs)


def test_adapters_never_share_prefix_blocks(tiny_adapters):
    folder, loras, refs = tiny_adapters
    prompt = {"prompt_token_ids": _prompts([64], seed=2)[0]}
    sp = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        def cached(lora):
            return llm.generate(prompt, sp, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

        assert cached(loras["all8"]) == 0
        assert cached(loras["qv4"]) == 0      # same tokens, another adapter: nothing to reuse
        assert cached(None) == 0              # nor for the base model
        assert cached(loras["all8"]) == 48    # its own earlier blocks (three full ones; the last token is computed)


def test_bad_adapters_are_refused_naming_the_field(tiny_adapters, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, loras, _ = tiny_adapters
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_lora_rank=4) as llm:
        def refused(lora, match):
            with pytest.raises(ValueError, match=match):
                llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)

        refused(loras["all8"], "rank 8 is larger than max_lora_rank \\(4\\)")
        refused(LoRARequest("gone", 9, str(tmp_path / "nowhere")), "no such folder")
        other = tiny_model_dir("qwen3")   # another base model: its q_proj is [128, 64], this one's [64, 64]
        make_adapter(lambda: AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32), tmp_path / "qwen3",
                     4, 4, ["q_proj"])
        refused(LoRARequest("qwen3", 10, str(tmp_path / "qwen3")), "another base model")
        head = tmp_path / "head"
        make_adapter(lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), head, 5, 4,
                     ["lm_head"])
        refused(LoRARequest("head", 11, str(head)), "does not adapt")
        (tmp_path / "dora").mkdir()
        config = json.loads((tmp_path / "qwen3" / "adapter_config.json").read_text())
        (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(
            (tmp_path / "qwen3" / "adapter_model.safetensors").read_bytes())
        refused(LoRARequest("dora", 12, str(tmp_path / "dora")), "use_dora")
        refused(LoRARequest("zero", 0, str(head)), "lora_int_id")
        assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB") as plain:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["qv4"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_smollm2_adapter_equals_peft_merged_model(smol_hf, smol_tokenizer, tmp_path):
    """The embedded model (GGUF, fp32) with an adapter on every projection equals peft's merged model."""
    ref = make_adapter(lambda: copy.deepcopy(smol_hf), tmp_path / "smol", 7, 8, ALL, std=0.05)
    prompt = smol_tokenizer("The capital of France is").input_ids
    lora = LoRARequest("smol", 1, str(tmp_path / "smol"))
    with LLM(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=8) as llm:
        ours = _greedy(llm, [prompt, prompt], [lora, None])
    _check_against_peft(ours[:1], [prompt], ["smol"], {"smol": ref})
    assert ours[0][0] != ours[1][0], "the adapter did not change the answer"


@pytest.mark.slow
def test_server_serves_adapters_and_changes_them_while_requests_run(tiny_adapters, smol_tokenizer):
    """A request picks its adapter by `model`; an adapter loaded while another request streams serves at once,
    and one unloaded meanwhile lets its running request finish, then answers 404."""
    import threading

    import requests
    from server_utils import ServerProcess

    folder, loras, refs = tiny_adapters
    prompt = _prompts([21], seed=3)[0]

    def expected(name):
        return smol_tokenizer.decode(hf_greedy(refs[name], prompt, NEW_TOKENS)[0])

    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory",
                           "32MiB", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                           f"all8={loras['all8'].lora_path}", "--allow-runtime-lora-updating")
    try:
        def complete(model, **extra):
            return requests.post(server.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                **extra})

        cards = requests.get(server.url + "/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("all8", "tiny")]
        r = complete("all8")
        assert r.status_code == 200 and r.json()["model"] == "all8"
        assert r.json()["choices"][0]["text"] == expected("all8")
        assert complete("tiny").json()["choices"][0]["text"] == expected(None)
        assert complete("qv4").status_code == 404

        long = {}
        thread = threading.Thread(target=lambda: long.update(r=complete("all8", max_tokens=400)))
        thread.start()
        load = requests.post(server.url + "/v1/load_lora_adapter",
                             json={"lora_name": "qv4", "lora_path": loras["qv4"].lora_path})
        assert load.status_code == 200, load.text
        assert complete("qv4").json()["choices"][0]["text"] == expected("qv4")
        assert requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all8"}).status_code == 200
        thread.join(120)
        assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 400
        assert complete("all8").status_code == 404
        bad = requests.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert bad.status_code == 400 and "no such folder" in bad.json()["error"]["message"]
        again = requests.post(server.url + "/v1/load_lora_adapter",
                              json={"lora_name": "qv4", "lora_path": loras["qv4"].lora_path})
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        assert [c["id"] for c in requests.get(server.url + "/v1/models").json()["data"]] == ["tiny", "qv4"]
    finally:
        server.stop()


def test_runtime_updates_are_off_by_default():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.openai.errors import add_exception_handlers
    from tokenmill.entrypoints.openai.routes import admin
    from tokenmill.entrypoints.openai.serving_models import parse_lora_modules

    app = FastAPI()
    add_exception_handlers(app)
    app.include_router(admin.router)
    app.state.parts = SimpleNamespace(allow_runtime_lora_updating=False, ctx=None)
    r = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    assert [(m.name, m.path) for m in parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}'])] == \
        [("a", "/x"), ("b", "/y")]
    for bad in ["a", "=x", '{"name": "b"}']:
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
