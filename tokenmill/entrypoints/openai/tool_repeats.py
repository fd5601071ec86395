"""tool_choice "required" without the loop: the grammar lets the call list go on, and a small model at
temperature 0 repeats its call until max_tokens (issue 58: `finish_reason: "length"`, the last call cut mid-way).
The answer's list is closed before the first call that repeats an earlier one, word for word: the request stops
there (its engine request aborted) and ends as a list of distinct, complete calls. While the open call could still
become such a repeat, its text is held back from the stream, so a client never sees a call that is then dropped.
At max_tokens, a call cut mid-way that was not streamed yet is dropped the same way (finish_reason stays
"length"): what comes back as tool_calls is always complete JSON."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from tokenmill.outputs import RequestOutput

_DECODER = json.JSONDecoder()
_SEPARATOR = ", "   # the constrained JSON's item separator (grammar_text.JSON_OPTIONS)


@dataclass
class CallList:
    """Where a constrained list of calls stands: the complete items' spans, and whether the list is closed."""
    items: list[tuple[int, int]]
    closed: bool

    @staticmethod
    def scan(text: str) -> CallList:
        items: list[tuple[int, int]] = []
        if not text.startswith("["):
            return CallList(items, False)
        pos = 1
        while pos < len(text):
            try:
                _, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                break   # the open item is still being written
            items.append((pos, end))
            if text.startswith("]", end):
                return CallList(items, True)
            if not text.startswith(_SEPARATOR, end):
                break
            pos = end + len(_SEPARATOR)
        return CallList(items, False)


def close_before_repeat(text: str, calls: CallList | None = None) -> str | None:
    """The answer closed before its first complete call that repeats an earlier one; None while there is none.
    (`calls`: the text's scan, when the caller has it.)"""
    calls = calls or CallList.scan(text)
    if len(calls.items) < 2 or calls.closed:
        return None
    spans = [text[s:e] for s, e in calls.items]
    first = next((k for k in range(1, len(spans)) if spans[k] in spans[:k]), None)
    return None if first is None else text[:calls.items[first - 1][1]] + "]"


def close_at_last_call(text: str, sent: int, calls: CallList | None = None) -> str | None:
    """At max_tokens: the list closed after its last complete call, dropping the cut one, when none of the cut
    one has been streamed yet; else None."""
    calls = calls or CallList.scan(text)
    if calls.closed or not calls.items or sent > calls.items[-1][1]:
        return None
    return text[:calls.items[-1][1]] + "]"


def safe_length(text: str, calls: CallList | None = None) -> int:
    """How much of the text can be streamed: all of it, unless what follows the last complete call could still
    turn into a repeat (a separator, and the start of an earlier call's exact text)."""
    calls = calls or CallList.scan(text)
    if calls.closed or not calls.items:
        return len(text)
    last_end = calls.items[-1][1]
    rest = text[last_end:]
    if _SEPARATOR.startswith(rest):
        return last_end
    if not rest.startswith(_SEPARATOR):
        return len(text)
    open_item = rest[len(_SEPARATOR):]
    if any(text[s:e].startswith(open_item) for s, e in calls.items):
        return last_end
    return len(text)


async def without_repeated_calls(stream: AsyncIterator[RequestOutput], whole: bool) -> AsyncIterator[RequestOutput]:
    """The stream of a one-choice "required" request (its outputs are deltas), closed before a repeated call.
    `whole`: the caller wants one final output with all the text (a non-streamed answer) instead of deltas."""
    text, sent, token_ids, logprobs = "", 0, [], []
    outputs = aiter(stream)
    try:
        async for ro in outputs:
            c = ro.outputs[0]
            text += c.text
            token_ids += c.token_ids
            if c.logprobs is not None:
                logprobs += c.logprobs
            calls = CallList.scan(text)   # once a delta: the three checks below share it
            closed = close_before_repeat(text, calls)
            if closed is not None:
                text, c = closed, replace(c, finish_reason="stop", stop_reason=None)
                ro = replace(ro, finished=True)
            elif c.finish_reason == "length":
                text = close_at_last_call(text, 0 if whole else sent, calls) or text
            if whole and ro.finished:
                yield replace(ro, outputs=[replace(c, text=text, token_ids=token_ids,
                                                   logprobs=logprobs if c.logprobs is not None else None)])
            elif not whole:
                upto = len(text) if ro.finished else max(sent, safe_length(text, calls))
                yield replace(ro, outputs=[replace(c, text=text[sent:upto])])
                sent = upto
            if ro.finished:
                return
    finally:
        await outputs.aclose()   # stopped early: the engine's request is aborted now, not when collected
