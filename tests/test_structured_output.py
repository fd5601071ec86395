"""Structured output on the embedded model: every constrained answer parses and validates, at temperature 0 and 1
with several seeds; the mask leaves other rows alone, picks what logit_bias would pick, and stays lossless with
speculative decoding and through preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.grammar_text import validate

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "tags"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name"],
                 "properties": {"name": NAME, "email": {"type": "string", "maxLength": 30}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}},
    "enum_and_bounds": {"type": "object", "additionalProperties": False, "required": ["color", "score", "ok"],
                        "properties": {"color": {"enum": ["red", "green", "blue"]},
                                       "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                       "ok": {"type": "boolean"}}},
    "optional_fields": {"type": "object", "additionalProperties": False, "required": ["id"],
                        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                       "note": {"type": "string", "maxLength": 20},
                                       "level": {"type": "integer", "minimum": 0, "maximum": 5}}},
    "ref": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                               "y": {"type": "integer", "minimum": -50, "maximum": 50}}}},
            "type": "object", "additionalProperties": False, "required": ["start", "end"],
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "free_numbers": {"type": "object", "additionalProperties": False, "required": ["mass", "count"],
                     "properties": {"mass": {"type": "number"}, "count": {"type": "integer"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe), because [a-z ]{1,20}\.", r"[A-Z][a-z]{2,8} [0-9]{1,2}"]
CHOICES = [["Paris", "London", "Berlin", "Rome"], ["positive", "negative", "neutral"]]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", kv_cache_memory="256MiB", max_num_seqs=16)


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def free_whitespace(text: str) -> list[str]:
    """Whitespace outside JSON strings other than json.dumps' one space after ',' and ':' (inside a string any
    character is the model's to write)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.findall(r"(?<![,:]) |\s(?<! )|  ", bare)


def test_free_whitespace_is_found_outside_strings_only():
    assert free_whitespace('{"a": "x  \\" \n y", "b": [1, 2]}') == []
    assert free_whitespace('{"a":  1}') and free_whitespace('{"a": 1 }') and free_whitespace('{"a": 1,\n"b": 2}')


def sampled(temperature: float, seed: int, so: StructuredOutputsParams, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so)


def test_every_output_is_valid_at_temperature_0_and_1(llm):
    """The validity count the issue asks for: each constraint at T=0 and at T=1 with three seeds."""
    prompts, params, checks = [], [], []
    for name, schema in SCHEMAS.items():
        for temp, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)):
            prompts.append(chat(llm, f"Write a JSON example for a {name.replace('_', ' ')} record."))
            params.append(sampled(temp, seed, StructuredOutputsParams(json=schema)))
            checks.append(("json", schema))
    for rx in REGEXES:
        for temp, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
            prompts.append(chat(llm, "Answer briefly."))
            params.append(sampled(temp, seed, StructuredOutputsParams(regex=rx)))
            checks.append(("regex", rx))
    for options in CHOICES:
        for temp, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
            prompts.append(chat(llm, "Pick one."))
            params.append(sampled(temp, seed, StructuredOutputsParams(choice=options)))
            checks.append(("choice", options))
    outs = llm.generate(prompts, params, use_tqdm=False)
    valid = 0
    for out, (kind, spec) in zip(outs, checks):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (kind, spec, c.text)
        if kind == "json":
            jsonschema.validate(json.loads(c.text), spec)
            assert not free_whitespace(c.text), c.text
        elif kind == "regex":
            assert re.fullmatch(spec, c.text), (spec, c.text)
        else:
            assert c.text in spec
        valid += 1
    assert valid == len(checks) == 43
    print(f"structured outputs tried {len(checks)}, valid {valid}")


def test_json_object_at_temperature_1_cannot_pad_with_whitespace(llm):
    prompts = [chat(llm, "Reply with a JSON object.")] * 4
    params = [sampled(1.0, s, StructuredOutputsParams(json_object=True), max_tokens=48) for s in range(4)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        text = out.outputs[0].text
        assert text.startswith("{") and "\n" not in text and "\t" not in text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_mask_leaves_other_rows_alone(smol_llm):
    """A constrained and an unconstrained request in one batch: the unconstrained one says what it says alone
    (fp32, where a batch gives each request's tokens exactly)."""
    free = chat(smol_llm, "Tell me about the sea.")
    alone = smol_llm.generate([free], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    both = smol_llm.generate([chat(smol_llm, "JSON please."), free],
                             [sampled(0.0, 0, StructuredOutputsParams(json=SCHEMAS["flat"])),
                              SamplingParams(temperature=0, max_tokens=24)], use_tqdm=False)
    assert both[1].outputs[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(both[0].outputs[0].text), SCHEMAS["flat"])


def test_greedy_under_a_mask_picks_what_logit_bias_picks(llm):
    """Independent of the bitmask code: +100 on the ten digit tokens makes the unconstrained argmax the best
    digit; the regex [0-9] must choose the same token."""
    tok = llm.get_tokenizer()
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digits)) == 10
    for text in ("How many legs does a cat have?", "Pick a number.", "What is 2+5?"):
        prompt = chat(llm, text)
        biased = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                       logit_bias={d: 100.0 for d in digits}), use_tqdm=False)
        masked = llm.generate([prompt], sampled(0.0, 0, StructuredOutputsParams(regex="[0-9]"), 4), use_tqdm=False)
        assert masked[0].outputs[0].token_ids[:1] == biased[0].outputs[0].token_ids


def test_n_children_each_follow_the_grammar(llm):
    out = llm.generate([chat(llm, "Give me a person.")],
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMAS["flat"])),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["flat"])


def test_min_tokens_yields_to_a_finished_grammar(llm):
    """min_tokens forbids EOS, a finished grammar allows only EOS: the grammar wins and the request ends."""
    for temp in (0.0, 1.0):
        out = llm.generate([chat(llm, "Yes or no?")], SamplingParams(
            temperature=temp, seed=1, max_tokens=20, min_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_compiled_once_per_distinct_grammar(llm):
    backend = llm.engine_core.structured_output.backend()
    before = (backend.stats.num_compiled, backend.stats.num_cache_hits)
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    llm.generate([chat(llm, "x")] * 3, sampled(0.0, 0, StructuredOutputsParams(json=schema), 24), use_tqdm=False)
    assert backend.stats.num_compiled == before[0] + 1
    assert backend.stats.num_cache_hits == before[1] + 2


@pytest.mark.parametrize("kwargs, field", [
    ({"json": {"type": "objekt"}}, "structured_outputs.json"),
    ({"json": {"type": "string", "format": "not-a-format"}}, "structured_outputs.json"),
    ({"json": '{"type": '}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_bad_constraints_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        validate(StructuredOutputsParams(**kwargs))


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_gbnf_and_lark_grammars(llm):
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark = 'start: "Color: " COLOR\nCOLOR: "red" | "green"'
    outs = llm.generate([chat(llm, "Is water wet?")] * 2,
                        [sampled(1.0, 3, StructuredOutputsParams(grammar=gbnf)),
                         sampled(1.0, 4, StructuredOutputsParams(grammar=lark))], use_tqdm=False)
    assert outs[0].outputs[0].text in ("The answer is yes.", "The answer is no.")
    assert outs[1].outputs[0].text in ("Color: red", "Color: green")


@pytest.mark.slow
def test_lossless_with_speculative_decoding_and_preemption():
    """n-gram drafts are cut to what the grammar allows and verified under one mask per position; greedy output
    is the same with speculation on, and when a small KV cache forces preemption (recompute) midway."""
    so = StructuredOutputsParams(json=SCHEMAS["array_of_objects"])
    base = LLM(dtype="bfloat16", kv_cache_memory="256MiB")
    tok = base.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List {k} items as JSON, like "
                                         '[{"sku": "ABC-12", "qty": 3}, {"sku": "ABC-13", "qty": 3}].'}],
                                       tokenize=False, add_generation_prompt=True) for k in (2, 3, 3, 2)]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    del base
    spec = LLM(dtype="bfloat16", kv_cache_memory="256MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == ref
    accepted = spec.spec_decoding_stats.num_accepted_tokens
    assert accepted > 0
    del spec
    tight = LLM(dtype="bfloat16", num_gpu_blocks_override=14, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == ref
    assert tight.engine_core.scheduler.num_preemptions > 0
    for ids in ref:
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMAS["array_of_objects"])


def test_new_grammars_compile_off_the_engine_step(llm, monkeypatch):
    """A grammar not yet compiled waits beside the scheduler (the engine keeps stepping for the others); an abort
    while it compiles drops it; a grammar that fails to compile fails only its request."""
    core = llm.engine_core
    schema = {"type": "object", "properties": {"async_only": {"type": "boolean"}}, "required": ["async_only"]}
    llm.generate([chat(llm, "x")], sampled(0.0, 0, StructuredOutputsParams(json={**schema, "title": "a"}), 16),
                 use_tqdm=False)
    assert not core.waiting_for_grammar and not core.has_unfinished_requests()

    request = llm.input_processor.make_request("pending", llm.input_processor.process_prompt("hi"),
                                               sampled(0.0, 0, StructuredOutputsParams(json={**schema, "title": "b"})))
    core.add_request(request)
    assert "pending" in core.waiting_for_grammar and core.has_unfinished_requests()
    core.abort_requests(["pending"])
    assert not core.has_unfinished_requests()

    backend = core.structured_output.backend()
    monkeypatch.setattr(backend, "compile", lambda *a, **k: (_ for _ in ()).throw(ValueError("no luck")))
    bad = sampled(0.0, 0, StructuredOutputsParams(json={**schema, "title": "c"}))
    with pytest.raises(ValueError, match="no luck"):
        llm.generate([chat(llm, "x")], bad, use_tqdm=False)
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_bitmask_kernel_matches_torch(dtype):
    from tokenmill.structured_output.bitmask import _native, apply_token_bitmask, apply_token_bitmask_torch

    if not _native():
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(0)
    vocab = 49152 + 7   # not a multiple of 32: the last word's extra bits must be ignored
    logits = torch.randn(9, vocab, generator=g).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int32)
    bitmask[0] = -1                  # all allowed
    bitmask[1] = 0                   # nothing allowed
    bitmask[2, ::3] = -1
    rows = torch.tensor([8, 0, 3, 5, 1])
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, rows, bitmask)
    apply_token_bitmask_torch(ref, rows, bitmask)
    assert torch.equal(ours, ref)
    assert torch.isneginf(ours[0]).all() and not torch.isneginf(ours[8]).any()
