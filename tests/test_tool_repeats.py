"""The guard that closes a "required" call list before a repeated call (issue 58), on text alone and over a
stream of deltas split at every character: the client's text is the closed list, no character of the repeat is
ever streamed, and stopping early closes the engine's stream (which aborts its request)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.entrypoints.openai.tool_repeats import (
    close_at_last_call,
    close_before_repeat,
    safe_length,
    without_repeated_calls,
)
from tokenmill.outputs import CompletionOutput, RequestOutput

ADD = '{"name": "add", "parameters": {"a": 10, "b": 20}}'
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'


def test_the_list_closes_before_the_first_word_for_word_repeat():
    assert close_before_repeat(f"[{ADD}, {WEATHER}, {ADD}") == f"[{ADD}, {WEATHER}]"
    assert close_before_repeat(f"[{ADD}, {ADD}, {ADD}") == f"[{ADD}]"
    assert close_before_repeat(f"[{ADD}, {WEATHER}") is None                 # distinct calls go on
    assert close_before_repeat(f"[{ADD}, {ADD[:-3]}") is None                # a repeat not complete yet
    assert close_before_repeat(f"[{ADD}, {ADD}]") is None                    # the model closed it itself
    other = ADD.replace("20", "21")
    assert close_before_repeat(f"[{ADD}, {other}") is None                   # same function, other arguments


def test_what_could_still_become_a_repeat_is_held_back():
    head = f"[{ADD}"
    assert safe_length(head) == len(head)
    assert safe_length(head + ",") == len(head)
    assert safe_length(head + ', {"name": "a') == len(head)                 # a prefix of ADD
    assert safe_length(head + ', {"name": "g') == len(head) + len(', {"name": "g')   # diverged: streamed
    assert safe_length(head + "]") == len(head) + 1
    assert safe_length('[{"name": "ad') == len('[{"name": "ad')           # the first call streams as it comes


def test_a_call_cut_at_max_tokens_is_dropped_unless_already_streamed():
    text = f"[{ADD}, {WEATHER[:20]}"
    assert close_at_last_call(text, 0) == f"[{ADD}]"
    assert close_at_last_call(text, len(text)) is None
    assert close_at_last_call(f"[{ADD[:10]}", 0) is None                  # no complete call: nothing to keep


class FakeStream:
    """The engine's deltas of one text, a character each; records whether it was closed early."""

    def __init__(self, text: str, finish: str = "length"):
        self.text, self.finish, self.closed = text, finish, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            for i, ch in enumerate(self.text):
                last = i == len(self.text) - 1
                yield RequestOutput("r", None, [1], [CompletionOutput(0, ch, [i], finish_reason=self.finish
                                                                      if last else None)], last)
        finally:
            self.closed = True


@pytest.mark.parametrize("whole", [False, True])
def test_over_a_stream_the_client_gets_the_closed_list_and_none_of_the_repeat(whole):
    async def run():
        source = FakeStream(f"[{ADD}, {WEATHER}, {ADD}, {ADD}, {ADD[:7]}")
        outs = [ro async for ro in without_repeated_calls(source, whole)]
        return source, outs

    source, outs = asyncio.run(run())
    text = "".join(o.outputs[0].text for o in outs)
    assert text == f"[{ADD}, {WEATHER}]" and json.loads(text)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert len(outs) == 1 if whole else len(outs) > 1
    assert source.closed and not source.text.endswith(text)       # stopped before the stream's own end
    if whole:
        assert outs[0].outputs[0].token_ids == list(range(len(f"[{ADD}, {WEATHER}, {ADD}")))


def test_a_list_the_model_ends_itself_passes_through_unchanged():
    async def run():
        return [ro async for ro in without_repeated_calls(FakeStream(f"[{ADD}, {WEATHER}]", "stop"), False)]

    outs = asyncio.run(run())
    assert "".join(o.outputs[0].text for o in outs) == f"[{ADD}, {WEATHER}]"
    assert outs[-1].outputs[0].finish_reason == "stop"
