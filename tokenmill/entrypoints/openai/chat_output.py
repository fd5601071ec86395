"""What a chat answer is made of besides text: the tool-call mode of a request, and turning generated text into
reasoning, content and tool calls, whole (non-streamed) or as deltas (streamed) with the same parsers."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.structured_output.reasoning import ReasoningParser, ReasoningStreamer
from tokenmill.structured_output.tool_parsers import (
    TOOL_PARSERS,
    Parser,
    ToolCallStreamer,
    named_parser,
    parse_required,
    tool_calls,
)
from tokenmill.structured_output.tools import ToolChoice


@dataclass
class ChatOutputOptions:
    """The server's switches (vLLM's flags)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: ReasoningParser | None = None


def tool_parser_for(choice: ToolChoice, options: ChatOutputOptions) -> Parser | None:
    if choice.mode == "named":
        return named_parser(choice.name)
    if choice.mode == "required":
        return parse_required
    if choice.mode == "auto":
        return TOOL_PARSERS[options.tool_call_parser]
    return None


def finish_reason(reason: str | None, choice: ToolChoice, called: bool) -> str | None:
    """OpenAI says "tool_calls" when the model called tools on its own or was required to; a named tool_choice
    ends with "stop", as OpenAI's does."""
    if reason == "stop" and called and choice.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def chat_message(text: str, parser: Parser | None, reasoning: ReasoningParser | None) -> tuple[dict, bool]:
    """The assistant message of a finished answer, and whether it called tools."""
    message: dict = {"role": "assistant"}
    if reasoning is not None:
        message["reasoning_content"], text = reasoning.split(text, final=True)
        message["reasoning_content"] = message["reasoning_content"] or None
    message["content"] = text
    if parser is None:
        return message, False
    parsed = parser(text, True)
    calls = tool_calls(parsed)
    if calls:
        message["content"] = parsed.content
        message["tool_calls"] = calls
    return message, bool(calls)


class ChatDeltaStream:
    """One choice of a streamed answer: each update takes all text so far and returns the chunk's delta."""

    def __init__(self, parser: Parser | None, reasoning: ReasoningParser | None):
        self.reasoning = ReasoningStreamer(reasoning) if reasoning is not None else None
        self.tools = ToolCallStreamer(parser) if parser is not None else None
        self.text = ""
        self.content_sent = 0

    def update(self, new_text: str, final: bool) -> dict:
        self.text += new_text
        delta: dict = {}
        content = self.text
        if self.reasoning is not None:
            reasoning_delta, content = self.reasoning.update(self.text, final)
            if reasoning_delta:
                delta["reasoning_content"] = reasoning_delta
        if self.tools is not None:
            content_delta, calls = self.tools.update(content, final)
            if calls:
                delta["tool_calls"] = calls
        else:
            content_delta, self.content_sent = content[self.content_sent:], max(self.content_sent, len(content))
        if content_delta:
            delta["content"] = content_delta
        return delta

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called
