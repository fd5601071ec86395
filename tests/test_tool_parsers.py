"""Tool-call and reasoning parsers: what they read from whole answers, and that streamed deltas, however the text
is cut into chunks, reassemble into exactly the non-streamed answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.entrypoints.openai.chat_output import ChatDeltaStream, chat_message
from tokenmill.structured_output.reasoning import REASONING_PARSERS, after_reasoning
from tokenmill.structured_output.tool_parsers import (
    named_parser,
    parse_hermes,
    parse_llama3_json,
    parse_pythonic,
    parse_required,
    scan_calls,
)
from tokenmill.structured_output.tools import (
    check_tools,
    messages_without_tool_support,
    resolve_tool_choice,
    tool_constraint,
)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"a": "}"}]}}'
          '\n</tool_call>\n<tool_call>{"arguments": {"x": "say \\"hi\\""}, "name": "echo"}</tool_call>')
REQUIRED = '[{"name": "add", "parameters": {"a": 1, "b": -2.5}}, {"name": "now", "parameters": {}}]'
TEXTS = [("hermes", parse_hermes, HERMES), ("hermes", parse_hermes, "No tools needed <tool maybe? not really."),
         ("required", parse_required, REQUIRED), ("named", named_parser("add"), '{"a": 3, "b": 4}'),
         ("llama3_json", parse_llama3_json, '<|python_tag|>{"name": "f", "parameters": {"q": "x;y"}}'),
         ("pythonic", parse_pythonic, '[get_weather(city="Paris", days=3), now()]')]


def test_hermes_reads_content_and_calls_in_order():
    out = parse_hermes(HERMES, True)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, {"a": "}"}]}), ("echo", {"x": 'say "hi"'})]


def test_other_formats():
    assert [(c.name, json.loads(c.arguments)) for c in parse_required(REQUIRED, True).calls] == [
        ("add", {"a": 1, "b": -2.5}), ("now", {})]
    assert [(c.name, json.loads(c.arguments)) for c in parse_pythonic(TEXTS[5][2], True).calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert parse_pythonic("[os.system('rm -rf /')]", True).calls == []   # never evaluated, not a plain call
    assert parse_llama3_json(TEXTS[4][2], True).calls[0].arguments == '{"q": "x;y"}'
    assert scan_calls('{"name": "f", "arguments": 12}', 1)[0].arguments == "12"


def reassemble(parser, text: str, cuts: list[int], reasoning=None) -> dict:
    stream = ChatDeltaStream(parser, reasoning)
    content, reasoning_text, calls = "", "", {}
    bounds = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    start = 0
    for end in bounds:
        d = stream.update(text[start:end], end == len(text))
        start = end
        content += d.get("content", "")
        reasoning_text += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert call["name"] is None, "id and name are sent once"
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
    return {"content": content, "reasoning": reasoning_text, "calls": [calls[i] for i in sorted(calls)]}


def whole(parser, text: str, reasoning=None) -> dict:
    message, _ = chat_message(text, parser, reasoning)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return {"content": message["content"] or "", "reasoning": message.get("reasoning_content") or "",
            "calls": calls}


@pytest.mark.parametrize("kind, parser, text", TEXTS, ids=[t[0] for t in TEXTS])
def test_streaming_one_character_at_a_time_equals_whole(kind, parser, text):
    assert reassemble(parser, text, list(range(len(text)))) == whole(parser, text)


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 200), max_size=30),
       think=st.sampled_from(["", "<think>I should call a tool.</think>\n\n", "pondering</think>"]))
def test_streaming_any_chunking_equals_whole(case, cuts, think):
    _, parser, text = case
    reasoning = REASONING_PARSERS["deepseek_r1"] if think else None
    text = think + text
    assert reassemble(parser, text, cuts, reasoning) == whole(parser, text, reasoning)


def test_reasoning_split():
    r1, qwen = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    assert r1.split("<think>a</think>\n\nb", True) == ("a", "b")
    assert r1.split("still thinking", True) == ("still thinking", "")
    assert qwen.split("plain answer", True) == ("", "plain answer")
    assert r1.split("a</thi", False) == ("a", "")   # held back: it may be the end marker


def test_grammar_applies_after_reasoning(smol_tokenizer):
    import llguidance.hf

    from tokenmill.structured_output.grammar_text import JSON_OPTIONS

    tok = llguidance.hf.from_tokenizer(smol_tokenizer, n_vocab=49152, eos_token=[2])
    inner = llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                           "required": ["a"]}, defaults=dict(JSON_OPTIONS))
    grammar = after_reasoning(inner)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""

    def fits(text: str) -> bool:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        return llguidance.LLMatcher(tok, grammar).validate_tokens(ids) == len(ids)

    assert fits('<think>free {text} "here"</think>{"a": 5}')
    assert not fits("<think>free text</think>not json")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]


def test_tool_choice_rules():
    fns = check_tools(TOOLS)
    assert resolve_tool_choice(None, fns, True).mode == "auto"
    assert resolve_tool_choice(None, {}, False).mode == "none"
    assert resolve_tool_choice({"type": "function", "function": {"name": "now"}}, fns, False).name == "now"
    with pytest.raises(ValueError, match="tool_choice names function 'nope'"):
        resolve_tool_choice({"type": "function", "function": {"name": "nope"}}, fns, True)
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        resolve_tool_choice("auto", fns, False)
    with pytest.raises(ValueError, match="no tools"):
        resolve_tool_choice("required", {}, True)
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        check_tools([{"type": "function", "function": {}}])


def test_required_schema_accepts_calls_and_rejects_others(smol_tokenizer):
    import llguidance.hf

    from tokenmill.structured_output.grammar_text import validate

    so, _ = tool_constraint(resolve_tool_choice("required", check_tools(TOOLS), True), check_tools(TOOLS))
    grammar = validate(so).grammar_text
    tok = llguidance.hf.from_tokenizer(smol_tokenizer, n_vocab=49152, eos_token=[2])

    def fits(text: str) -> bool:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        m = llguidance.LLMatcher(tok, grammar)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    assert fits('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert fits('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}]')
    assert not fits('[{"name": "get_weather", "parameters": {}}]')       # city is required
    assert not fits('[{"name": "delete_all", "parameters": {}}]')
    assert not fits("[]")


def test_templates_without_tools_get_the_tool_prompt():
    msgs = messages_without_tool_support(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "1", "content": "12:00"}], check_tools(TOOLS))
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


def test_structural_tag_constrains_only_inside_its_tags(smol_tokenizer):
    """vLLM's structural_tag: free text, and the schema between a tag's begin and end."""
    import llguidance.hf

    from tokenmill.structured_output.grammar_text import validate
    from tokenmill.structured_output.params import StructuredOutputsParams

    tag = {"structures": [{"begin": "<function=add>", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}, "end": "</function>"}], "triggers": ["<function="]}
    grammar = validate(StructuredOutputsParams(structural_tag=tag)).grammar_text
    tok = llguidance.hf.from_tokenizer(smol_tokenizer, n_vocab=49152, eos_token=[2])

    def fits(text: str) -> bool:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        return llguidance.LLMatcher(tok, grammar).validate_tokens(ids) == len(ids)

    assert fits('Let me add. <function=add>{"a": 3}</function> Done.')
    assert not fits("Let me add. <function=add>not json</function>")
    with pytest.raises(ValueError, match="structural_tag"):
        validate(StructuredOutputsParams(structural_tag={"structures": [{"begin": "x"}]}))
