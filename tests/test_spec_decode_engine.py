"""Speculative decoding in the engine: greedy answers identical to speculation off (n-gram, a draft checkpoint, the
int4 self-draft), with chunked prefill, prefix caching, preemption and mixed batches; sampled answers keep the
target's distribution (chi-square against transformers' exact probabilities); bad drafts fail at start."""

from __future__ import annotations

import json
import types
from importlib import resources

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import SchedulerStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def w7_prompts(smol_llm):
    chats = json.loads(resources.files("tokenmill.bench").joinpath("data/w7_chats.json").read_text())
    ip = smol_llm.input_processor
    return [{"prompt_token_ids": ip.process_prompt(ip.apply_chat_template(c, True, None),
                                                   add_special_tokens=False).prompt_token_ids} for c in chats[:4]]


@pytest.fixture(scope="module")
def w7_reference(smol_llm, w7_prompts):
    sp = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    return [smol_llm.generate(p, sp, use_tqdm=False)[0].outputs[0] for p in w7_prompts]


def _check_same(outs, reference):
    for out, ref in zip(outs, reference):
        got = out.outputs[0]
        assert list(got.token_ids) == list(ref.token_ids)
        for lp, ref_lp, tok in zip(got.logprobs, ref.logprobs, ref.token_ids):
            assert abs(lp[tok].logprob - ref_lp[tok].logprob) < 1e-4
            assert set(lp) == set(ref_lp)


@pytest.mark.parametrize("name, kwargs", [
    pytest.param("alone", dict(), marks=pytest.mark.slow),   # (make test: the EAGLE and draft-model equalities)
    pytest.param("batched_chunked_cached", dict(max_num_batched_tokens=40, disable_by_batch_size=None),
                 marks=pytest.mark.slow),
    pytest.param("preempting", dict(num_gpu_blocks_override=24, max_model_len=384, disable_by_batch_size=None),
                 marks=pytest.mark.slow),
])
def test_ngram_greedy_answers_are_unchanged(name, kwargs, w7_prompts, w7_reference):
    spec = {**NGRAM, **({"disable_by_batch_size": kwargs.pop("disable_by_batch_size")}
                        if "disable_by_batch_size" in kwargs else {})}
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", speculative_config=spec, **kwargs)
    sp = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    if name == "alone":
        outs = [llm.generate(p, sp, use_tqdm=False)[0] for p in w7_prompts]
    else:   # all at once, plus a repeat of the first (a prefix hit) and a plain request that never drafts
        outs = llm.generate(w7_prompts + [w7_prompts[0]], sp, use_tqdm=False)
        _check_same(outs[-1:], w7_reference[:1])
        outs = outs[:-1]
    _check_same(outs, w7_reference)
    stats = llm.spec_decoding_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    sched = llm.engine_core.scheduler
    if name == "preempting":
        assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.pool.num_free_blocks == sched.kv_cache_manager.pool.num_blocks


@pytest.mark.slow
def test_penalties_bias_and_min_tokens_see_the_drafts_before_them(smol_llm, w7_prompts):
    """Each verified row is constrained as its decode would be: penalties count the drafts before it, min_tokens
    keeps stop tokens out until enough tokens (drafts included) are out, logit_bias applies on every row."""
    stop = smol_llm.get_tokenizer().encode("```", add_special_tokens=False)[0]
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=30, stop_token_ids=[stop], repetition_penalty=1.02,
                        frequency_penalty=0.02, presence_penalty=0.02, logit_bias={stop + 1: 2.0}, logprobs=1)
    ref = smol_llm.generate(w7_prompts[:2], sp, use_tqdm=False)
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", speculative_config=NGRAM)
    outs = llm.generate(w7_prompts[:2], sp, use_tqdm=False)
    _check_same(outs, [r.outputs[0] for r in ref])
    assert llm.spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.slow
def test_int4_self_draft_greedy_answers_are_unchanged(w7_prompts, w7_reference):
    llm = LLM(dtype="float32", kv_cache_memory="128MiB",
              speculative_config={"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    outs = llm.generate(w7_prompts[:2], sp, use_tqdm=False)
    _check_same(outs, w7_reference[:2])
    # the target's own weights at 4 bits agree with it nearly always
    assert llm.spec_decoding_stats.acceptance_rate > 0.8


@pytest.mark.slow
def test_bf16_single_stream_is_identical_token_for_token(w7_prompts):
    """bf16 too: a verified draft's row goes through the same kernels as its decode would (up to 4 rows)."""
    import tokenmill.kernels as kernels

    if not kernels.native_kernels_for(torch.empty(1, dtype=torch.bfloat16)):
        pytest.skip("the native bf16 kernels are not available here")
    sp = SamplingParams(temperature=0, max_tokens=96)
    off = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    ref = [off.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in w7_prompts]
    del off
    on = LLM(dtype="bfloat16", kv_cache_memory="64MiB", speculative_config=NGRAM)
    assert [on.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in w7_prompts] == ref


# ---- a draft checkpoint ----------------------------------------------------------------------------
def test_draft_checkpoint_keeps_the_targets_answers(tiny_model_dir):
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen2")
    prompts = [[17 + (i * 7 + j) % 300 for j in range(20 + 5 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = LLM(str(target), dtype="float32", kv_cache_memory="16MiB")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    on = LLM(str(target), dtype="float32", kv_cache_memory="16MiB",
             speculative_config={"model": str(draft), "num_speculative_tokens": 2, "disable_by_batch_size": None})
    assert [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)] == ref
    assert on.spec_decoding_stats.num_draft_tokens > 0


def test_bad_drafts_fail_at_start_naming_the_field(tiny_model_dir, tmp_path):
    target = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="speculative_config.model.*does not exist"):
        LLM(target, speculative_config={"model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.*quantization"):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    other_vocab = _tiny_small_vocab(tmp_path / "small", vocab=64)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        LLM(target, speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2})


# ---- sampling keeps the distribution -----------------------------------------------------------------
def _tiny_small_vocab(folder, vocab: int):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, vocab_size=vocab,
                                   initializer_range=0.6, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 2},   # the argmax of a near twin
], ids=["ngram", "int8_self_draft"])
def test_sampled_tokens_follow_the_targets_distribution(spec, tmp_path, smol_tokenizer):
    """6,000 draws of four tokens at temperature 1 on a 12-token vocabulary. The prompt holds every token, so after
    the first token the n-gram proposer always drafts the next two, and the second and third tokens come out of the
    rejection sampler (accepted drafts, residual draws, bonus tokens). Their joint distribution is compared with
    transformers' exact one, sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2): chi-square at p > 0.001. The n-gram
    drafts are mostly rejected, the self-draft's mostly accepted: both halves of the sampler are exercised."""
    import transformers
    from scipy.stats import chisquare

    v = 12
    folder = _tiny_small_vocab(tmp_path / "tiny", vocab=v)
    smol_tokenizer.save_pretrained(folder)
    prompt = list(range(v)) * 2 + [0, 1, 2, 3, 4]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(hf(torch.tensor([prompt + [a] for a in range(v)])).logits[:, -1], -1)
        pairs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p3 = torch.softmax(hf(pairs).logits[:, -1], -1).view(v, v, v)
    expected = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten().double().numpy()
    n = 6000
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False,
              speculative_config={**spec, "disable_by_batch_size": None})
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    counts = np.zeros(v * v)
    for o in outs:
        toks = o.outputs[0].token_ids
        counts[toks[1] * v + toks[2]] += 1
    stats = llm.spec_decoding_stats
    assert stats.num_drafts >= n and 0 < stats.acceptance_rate < 1, stats
    keep = expected * n >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum()) * n
    exp[-1] += obs.sum() - exp.sum()
    p_value = chisquare(obs, exp).pvalue
    print(f"chi-square over {keep.sum() + 1} cells: p = {p_value:.3f}; acceptance {stats.describe()}")
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e} over {keep.sum() + 1} cells"


@pytest.mark.slow
def test_seeded_requests_repeat_with_speculation(w7_prompts):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", speculative_config=NGRAM)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24)
    first = llm.generate(w7_prompts[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([w7_prompts[1], w7_prompts[0]], sp, use_tqdm=False)[1].outputs[0].token_ids
    assert first == again


def test_metrics_count_drafts_with_vllm_names():
    from tokenmill.metrics import Metrics

    m = Metrics("x")
    m.record_engine(type("O", (), {"scheduler_stats": SchedulerStats(
        spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=4, spec_accepted_per_pos=[2, 1, 1])})())
    get = m.registry.get_sample_value
    assert get("tokenmill:spec_decode_num_drafts_total", {"model_name": "x"}) == 2
    assert get("tokenmill:spec_decode_num_draft_tokens_total", {"model_name": "x"}) == 6
    assert get("tokenmill:spec_decode_num_accepted_tokens_total", {"model_name": "x"}) == 4
    assert get("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "x", "position": "2"}) == 1


# ---- EAGLE -----------------------------------------------------------------------------------------
def _tiny_eagle_head(folder, target_dir, **overrides):
    """A random one-layer EAGLE-1 head for the tiny llama target, saved in the published layout: fc (with a bias),
    layers.0.* without an input norm, no embedding (the head reads the target's)."""
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.AutoConfig.from_pretrained(target_dir)
    cfg.num_hidden_layers = 1
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(9)
    body = transformers.LlamaModel(cfg).state_dict()
    tensors = {k: v for k, v in body.items() if k.startswith("layers.0.") and "input_layernorm" not in k}
    tensors["fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size) * 0.1
    tensors["fc.bias"] = torch.randn(cfg.hidden_size) * 0.1
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_draft_from_the_targets_hidden_states_and_change_nothing(method, tiny_model_dir, tmp_path):
    """Answers identical to the target alone (chunked prompts: the head mirrors every chunk), and the first drafts
    equal the definition computed from transformers' hidden states without any cache: EAGLE-1 pairs t[i+1] with
    the final hidden state f[i]; EAGLE-3 with fc of the residual streams entering three target layers."""
    import transformers

    from tokenmill.attention.registry import get_backend
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.spec_decode.eagle import _load_head
    from tokenmill.worker.input_batch import CachedRequestState
    from tokenmill.worker.varlen_batch import varlen_batch

    target = tiny_model_dir("llama")
    draft_vocab = None
    if method == "eagle":
        head_dir = _tiny_eagle_head(tmp_path / "eagle", target)
    else:
        head_dir, draft_vocab = _tiny_eagle3_head(tmp_path / "eagle3", target, draft_vocab=512)
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    prompts = [[17 + (i * 11 + j * 5) % 400 for j in range(30 + 9 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = LLM(str(target), dtype="float32", kv_cache_memory="16MiB")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    on = LLM(str(target), dtype="float32", kv_cache_memory="16MiB", speculative_config=spec,
             max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)] == ref
    assert on.spec_decoding_stats.num_draft_tokens > 0

    core = on.engine_core
    core.add_request(EngineCoreRequest("x", prompts[2], SamplingParams(temperature=0, max_tokens=8,
                                                                       ignore_eos=True), 0.0))
    while "x" not in core.scheduler.requests or not core.scheduler.requests["x"].spec_token_ids:
        core.step()
    req = core.scheduler.requests["x"]
    tokens, drafts = list(req.all_token_ids), list(req.spec_token_ids)
    if draft_vocab is not None:
        assert set(drafts) <= draft_vocab and core.executor.runner.model.model.aux_hidden_state_layers == (0, 1, 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        m = core.config.draft_model_config
        target_view = types.SimpleNamespace(model=hf.model, compute_logits=hf.lm_head, config=hf.config)
        head = _load_head(method, m, get_backend("torch_ref", "cpu"), "cpu", 512, target_view)
        pair_tokens = tokens[1:]
        pair_feats = head.features(hs[-1][0], {i: h[0] for i, h in enumerate(hs[:-1])})
        expected = []
        for _ in range(3):
            n = len(pair_tokens)
            head.attention_layers()[0].kv_cache = torch.zeros(2, 64, 16, m.num_kv_heads, m.head_dim)
            st = CachedRequestState.create("r", pair_tokens, n, sp, list(range(1, 1 + (n + 15) // 16)), 0, None)
            ids, pos, md = varlen_batch([st], np.array([0]), np.array([n]), 16)
            out, nxt = head(ids, pair_feats, pos, md)
            expected.append(int(head.draft(out[-1:])[0]))
            pair_tokens, pair_feats = pair_tokens + [expected[-1]], torch.cat([pair_feats, nxt[-1:]])
    assert drafts == expected


def test_eagle_head_for_another_model_is_refused(tiny_model_dir, tmp_path):
    head_dir = _tiny_eagle_head(tmp_path / "eagle", tiny_model_dir("llama"), hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="speculative_config.model.*hidden_size"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB",
            speculative_config={"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2})


def test_bench_spec_reports_both_sides(tiny_model_dir, tmp_path, capsys):
    import argparse

    from tokenmill.bench.spec import add_spec_args, run_spec_bench

    p = argparse.ArgumentParser()
    add_spec_args(p)
    out = tmp_path / "spec.json"
    ns = p.parse_args(["--workload", "W2", "--model", str(tiny_model_dir("llama")), "--dtype", "float32",
                       "--kv-cache-memory", "16MiB", "--output-json", str(out), "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    assert run_spec_bench(ns) == 0
    result = json.loads(out.read_text())
    assert result["outputs_identical"] is True and result["tpot_ms_off"] > 0 and result["tpot_ms_on"] > 0
    assert result["per_request"][0]["off_output_tokens"] == result["per_request"][0]["on_output_tokens"] == 256


def _tiny_eagle3_head(folder, target_dir, draft_vocab: int):
    """A random EAGLE-3 head in the published layout: midlayer.* (q/k/v read 2h, a hidden_norm), fc over three
    of the target's residual streams, norm, its own lm_head over a draft vocabulary and the d2t offsets."""
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.AutoConfig.from_pretrained(target_dir)
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    cfg.num_hidden_layers, cfg.draft_vocab_size = 1, draft_vocab
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    torch.manual_seed(4)
    body = transformers.LlamaModel(cfg).state_dict()
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in body.items() if k.startswith("layers.0.")}
    head_dim = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        tensors[f"midlayer.self_attn.{name}.weight"] = torch.randn(rows, 2 * h) * 0.2
    tensors["midlayer.hidden_norm.weight"] = torch.ones(h)
    tensors["fc.weight"] = torch.randn(h, 3 * h) * 0.1
    tensors["norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = torch.randn(draft_vocab, h)
    chosen = torch.sort(torch.randperm(cfg.vocab_size)[:draft_vocab]).values   # the draft vocabulary, in target ids
    tensors["d2t"] = chosen - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg.save_pretrained(folder)
    return folder, set(chosen.tolist())
