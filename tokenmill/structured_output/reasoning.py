"""Reasoning output: `<think>...</think>` split into `reasoning_content` and `content`, whole or streamed, and
grammars that apply only after the reasoning ends."""

from __future__ import annotations

import json
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """deepseek_r1: everything before </think> is reasoning (the template may open <think> in the prompt);
    qwen3: reasoning only inside an explicit <think>...</think> (no <think>: the model answered directly)."""
    name: str

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) so far; a possible start of </think> at the end is held back until known."""
        body = text
        if not final and THINK_START.startswith(body.lstrip()):
            return "", ""   # nothing yet, or the start of <think>
        if body.lstrip().startswith(THINK_START):
            body = body.lstrip()[len(THINK_START):]
        elif self.name == "qwen3":
            return "", text if final else _without_partial(text, THINK_START)
        at = body.find(THINK_END)
        if at < 0:
            return (body if final else _without_partial(body, THINK_END)), ""
        return body[:at], body[at + len(THINK_END):].lstrip("\n")


def _without_partial(text: str, marker: str) -> str:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1"), "qwen3": ReasoningParser("qwen3")}


class ReasoningStreamer:
    """Sends the reasoning as it grows; hands back the content text so far for the content/tool streamer."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, final)
        delta, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return delta, content


def after_reasoning(grammar_text: str) -> str:
    """The grammar, preceded by free text up to and including </think>: the constraint applies to the answer,
    not to the thinking."""
    inner = json.loads(grammar_text) if grammar_text.lstrip().startswith("{") else \
        {"grammars": [{"lark_grammar": grammar_text}]}
    grammars = [dict(g) for g in inner["grammars"]]
    grammars[0]["name"] = "answer"
    outer = {"name": "reasoned", "lark_grammar": f'start: think @answer\nthink[lazy]: TEXT "{THINK_END}"\n'
                                                 'TEXT: /(.|\\n)*/\n'}
    return json.dumps({"grammars": [outer, *grammars]})
