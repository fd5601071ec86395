"""Reading tool calls out of generated text, whole or as it streams.

Every parser is one function `parse(text, final) -> ParsedOutput`, monotone in the text: what it reports for a
prefix is a prefix of what it reports later. The streamer sends only the difference each time, so the deltas of
a stream always reassemble into the answer the same parser gives the finished text.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

_ARGS_KEYS = ("arguments", "parameters")


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""        # the raw JSON text of the arguments, as far as it has been generated


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[PartialCall] = field(default_factory=list)


Parser = Callable[[str, bool], ParsedOutput]


def scan_calls(text: str, depth: int) -> list[PartialCall]:
    """Objects opened at nesting `depth` (1: the text is one object; 2: objects in a top-level array), each with
    its complete "name" string and the raw text of its "arguments" (or "parameters") value so far."""
    calls: list[PartialCall] = []
    level, i, n = 0, 0, len(text)
    cur: PartialCall | None = None
    key, want_key, args_start, args_level = None, False, -1, -1
    while i < n:
        c = text[i]
        if c == '"':
            j, esc = i + 1, False
            while j < n and (esc or text[j] != '"'):
                esc = not esc and text[j] == "\\"
                j += 1
            done = j < n
            if cur is not None and level == depth and done:
                value = _json_string(text[i: j + 1])
                if want_key:
                    key = value
                elif key == "name" and cur.name is None:
                    cur.name = value
            if args_start == -2 and level == depth:   # a string as the arguments value
                args_start, args_level = i, level
            i = j + 1
            if args_start >= 0 and level == args_level and text[args_start] == '"' and done:
                cur.arguments, args_start = text[args_start:i], -1
            continue
        if args_start == -2 and level == depth and not c.isspace():   # the arguments value begins
            args_start, args_level = i, level
        if c in "{[":
            level += 1
            if c == "{" and level == depth:
                cur, key, want_key = PartialCall(), None, True
                calls.append(cur)
        elif c in "}]":
            level -= 1
            if args_start >= 0 and level == args_level and text[args_start] in "{[":
                cur.arguments, args_start = text[args_start: i + 1], -1
            elif args_start >= 0 and level == args_level - 1:   # a number or literal ends with its object
                cur.arguments, args_start = text[args_start:i].rstrip(), -1
            if level == depth - 1:
                cur = None
        elif cur is not None and level == depth:
            if c == ":":
                want_key = False
                if key in _ARGS_KEYS and not cur.arguments:
                    args_start = -2
            elif c == ",":
                if args_start >= 0:   # a number or literal as the arguments value
                    cur.arguments, args_start = text[args_start:i].rstrip(), -1
                want_key, key = True, None
        i += 1
    if args_start >= 0 and cur is not None:
        cur.arguments = text[args_start:]
    return calls


def _json_string(quoted: str) -> str | None:
    try:
        return json.loads(quoted)
    except json.JSONDecodeError:
        return None


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (not yet content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _content_until(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before the first marker (held back while it may be one), and where the marker starts."""
    at = text.find(marker)
    if at < 0:
        if final:
            return text, -1
        hold = _held_back(text, marker)
        body = text[: len(text) - hold]
        return body[: len(body.rstrip())] if not final else body, -1
    return text[:at].rstrip(), at


def parse_hermes(text: str, final: bool) -> ParsedOutput:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content."""
    content, at = _content_until(text, "<tool_call>", final)
    if at < 0:
        return ParsedOutput(content)
    calls = []
    for block in text[at:].split("<tool_call>")[1:]:
        calls.extend(scan_calls(block.split("</tool_call>")[0], 1)[:1])
    return ParsedOutput(content or None, calls)


def parse_llama3_json(text: str, final: bool) -> ParsedOutput:
    """Llama 3's JSON calls: optional <|python_tag|>, then {"name", "parameters"} objects joined by ';'."""
    body = text.removeprefix("<|python_tag|>").lstrip()
    if not (body.startswith("{") or "<|python_tag|>".startswith(text.lstrip()) and not final):
        return ParsedOutput(text if final else text[: len(text.rstrip())])
    if not body:
        return ParsedOutput(None)
    return ParsedOutput(None, scan_calls(body, 1))   # objects at the top level, whatever joins them (";")


def parse_pythonic(text: str, final: bool) -> ParsedOutput:
    """`[get_weather(city="Paris"), ...]`: read with ast, never evaluated; argument values must be literals.
    Calls come out when the list is complete (or at the end)."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return ParsedOutput(text if final else text[: len(text.rstrip())])
    if not final and not stripped.endswith("]"):
        return ParsedOutput(None)
    try:
        tree = ast.parse(stripped, mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) and isinstance(e.func, ast.Name)
                                                     for e in tree.elts):
            raise ValueError
        calls = [PartialCall(e.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in e.keywords},
                                                   ensure_ascii=False)) for e in tree.elts]
    except (SyntaxError, ValueError, TypeError):
        return ParsedOutput(text if final else None)
    return ParsedOutput(None, calls)


def parse_required(text: str, final: bool) -> ParsedOutput:
    """tool_choice "required": the constrained list [{"name": ..., "parameters": {...}}, ...]."""
    return ParsedOutput(None, scan_calls(text, 2))


def named_parser(name: str) -> Parser:
    """tool_choice naming a function: the whole (constrained) output is its arguments."""
    return lambda text, final: ParsedOutput(None, [PartialCall(name, text)])


TOOL_PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json,
                                   "pythonic": parse_pythonic}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def tool_calls(parsed: ParsedOutput) -> list[dict]:
    """OpenAI's tool_calls of a finished answer (calls without a name are dropped)."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
            for c in parsed.calls if c.name]


class ToolCallStreamer:
    """Turns the growing text into OpenAI deltas: content, then per call its id and name once, then argument
    fragments."""

    def __init__(self, parse: Parser):
        self.parse = parse
        self.content_sent = 0
        self.args_sent: list[int] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        parsed = self.parse(text, final)
        content = parsed.content or ""
        content_delta, self.content_sent = content[self.content_sent:], max(self.content_sent, len(content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.args_sent):
                if not call.name:
                    break
                self.args_sent.append(0)
                deltas.append({"index": i, "id": new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            args = call.arguments or ("{}" if final else "")
            if len(args) > self.args_sent[i]:
                deltas.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return content_delta, deltas

    @property
    def called(self) -> bool:
        return bool(self.args_sent)
