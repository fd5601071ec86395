"""StructuredOutputsParams with vLLM's names: exactly one constraint per request, checked when it is made."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of strings), `grammar`
    (Lark or GBNF/EBNF text), `json_object` (any JSON object) or `structural_tag` (vLLM's JSON form).
    `disable_any_whitespace` is accepted for vLLM compatibility: tokenmill never allows free whitespace in JSON
    (a small model at temperature 1 could otherwise pad with newlines until max_tokens)."""
    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    # Filled by validation: the backend's grammar text, so the engine core does not translate it again.
    grammar_text: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                 f"{type(self.json).__name__}")
            self.json = json.dumps(self.json)
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            self.structural_tag = json.dumps(self.structural_tag)
        if self.json_object is False:
            self.json_object = None
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)
