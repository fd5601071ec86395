"""Structured output: a grammar per request (JSON schema, regex, choice, Lark/GBNF grammar), a token bitmask per
step that the batched sampler applies, and the parsers that read tool calls and reasoning out of the text."""

from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
