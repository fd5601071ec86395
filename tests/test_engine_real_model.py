"""The engine with the real model: whatever the batching, chunking, caching or preemption, greedy tokens are
those each request gets alone; seeded sampling does not depend on the batch."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mixed_prompts():
    """32 prompts of 3..120 tokens; some share long prefixes so prefix caching has something to find (each costs
    ~0.7 s alone in fp32 for the reference: 64 made this file the suite's slowest)."""
    rng = random.Random(11)
    shared = [rng.randrange(17, 49152) for _ in range(48)]
    prompts = []
    for i in range(32):
        body = [rng.randrange(17, 49152) for _ in range(rng.randint(3, 72))]
        prompts.append((shared[: rng.choice([16, 32, 48])] + body) if i % 3 == 0 else body)
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def alone_reference(mixed_prompts):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in mixed_prompts]


@pytest.mark.parametrize("name, kwargs", [
    ("prefix_caching_on", dict(enable_prefix_caching=True)),
    pytest.param("prefix_caching_off", dict(enable_prefix_caching=False), marks=pytest.mark.slow),
    pytest.param("chunked_32", dict(max_num_batched_tokens=32), marks=pytest.mark.slow),
    ("preempting", dict(num_gpu_blocks_override=40, max_model_len=256)),
])
def test_mixed_prompts_match_alone(name, kwargs, mixed_prompts, alone_reference):
    llm = LLM(dtype="float32", **{"kv_cache_memory": "64MiB", **kwargs})
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(mixed_prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone_reference
    sched = llm.engine_core.scheduler
    if name == "preempting":
        assert sched.num_preemptions > 0, "the cache was meant to be too small to hold every request"
    if name == "prefix_caching_on":
        assert sum(o.num_cached_tokens for o in outs) > 0
    assert sched.kv_cache_manager.pool.num_free_blocks == sched.kv_cache_manager.pool.num_blocks


def test_seeded_sampling_is_independent_of_the_batch(smol_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=10, ignore_eos=True)
    alone = smol_llm.generate("Tell me a story", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True)
    batch = smol_llm.generate(["Hi", "Tell me a story", "What is the sky?"], [others, sp, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a, b = smol_llm.generate(["Tell me a story"] * 2, unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids, "unseeded requests draw different noise"


def test_n_gives_n_completions(smol_llm):
    out = smol_llm.generate("Name a fruit:", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8),
                            use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_strings_and_limits(smol_llm):
    base = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    incl = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == text[: text.index(stop) + len(stop)]
    capped = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=3),
                               use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_min_tokens_and_stop_token_ids(smol_llm):
    eos = smol_llm.config.model_config.eos_token_ids[0]
    out = smol_llm.chat([{"role": "user", "content": "What is 2+2?"}],
                        SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 64
    n = len(out.token_ids)
    longer = smol_llm.chat([{"role": "user", "content": "What is 2+2?"}],
                           SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3))[0].outputs[0]
    assert len(longer.token_ids) >= n + 3 and eos not in longer.token_ids[: n + 3]
    first = out.token_ids[0]
    stopped = smol_llm.chat([{"role": "user", "content": "What is 2+2?"}],
                            SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first


def test_penalties_and_logit_bias_change_the_output(smol_llm):
    prompt = "Repeat after me: la la la la la la"
    plain = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    penalized = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                  repetition_penalty=2.0, frequency_penalty=1.5), use_tqdm=False)[0].outputs[0]
    assert penalized.token_ids != plain
    forced = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                               logit_bias={1234: 100.0}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [1234] * 4


def test_prompt_logprobs_match_a_full_forward(smol_llm):
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = smol_llm.tokenizer(prompt).input_ids
    out = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2,
                            logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert ids[pos] in entry and len(entry) <= 3
    first = next(iter(out.outputs[0].logprobs[0].values()))
    assert first.rank >= 1


def test_engine_keeps_serving_after_a_bad_request(smol_llm):
    from tokenmill.engine.messages import EngineCoreRequest

    core = smol_llm.engine_core
    good = EngineCoreRequest("good", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0), 0.0)
    core.add_request(good)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(EngineCoreRequest("bad", [5] * 100000, SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(EngineCoreRequest("bad2", [10**9], SamplingParams(), 0.0))
    finished = []
    while core.has_unfinished_requests():
        finished += [o.request_id for o in core.step().outputs if o.finished]
    assert finished == ["good"]


def test_chat_takes_one_sampling_params_per_conversation(smol_llm):
    """vLLM's LLM.chat takes a list of SamplingParams as generate does: each conversation gets its own."""
    conv = [{"role": "user", "content": "Name a colour."}]
    outs = smol_llm.chat([conv, conv], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)],
                         use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        smol_llm.chat([conv, conv], [SamplingParams()], use_tqdm=False)


@pytest.mark.slow
def test_prompt_logprobs_are_sent_once_through_preemption(smol_llm):
    """A request preempted after its prompt recomputes it and scores it again; the client still gets one logprob
    per prompt token, equal to those of a run without preemption."""
    prompts = [[17 + (i * 31 + j * 7) % 3000 for j in range(40 + 3 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, prompt_logprobs=1)
    ref = smol_llm.generate(prompts, sp, use_tqdm=False)
    llm = LLM(dtype="float32", num_gpu_blocks_override=20, max_model_len=128)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine_core.scheduler.num_preemptions > 0
    for o, r, p in zip(outs, ref, prompts):
        assert len(o.prompt_logprobs) == len(p) == len(r.prompt_logprobs)
        for pos in range(1, len(p)):
            assert abs(o.prompt_logprobs[pos][p[pos]].logprob - r.prompt_logprobs[pos][p[pos]].logprob) < 1e-4
        assert o.outputs[0].token_ids == r.outputs[0].token_ids


def test_cache_salt_in_prompts_keeps_tenants_apart(smol_llm):
    prompt = list(range(300, 380))
    sp = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt):
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return smol_llm.generate(p, sp, use_tqdm=False)[0].num_cached_tokens

    smol_llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    assert cached("alice") == 0 and cached("alice") > 0
    assert cached("bob") == 0 and cached(None) == 0 and cached(None) > 0
    with pytest.raises(ValueError, match="cache_salt"):
        cached("")
