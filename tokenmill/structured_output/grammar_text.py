"""Request constraints to llguidance grammar text, and their validation, with no tokenizer: the front end runs
this, so a bad schema, regex or grammar is a 400 before anything is scheduled."""

from __future__ import annotations

import json

from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.utils import json_object

# JSON without free whitespace, with the separators Python's json.dumps writes (what small models saw most).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Numbers a schema leaves open are held to 15 integer digits and 6 decimals: at temperature 1 SmolLM2 wrote a float's
# decimals until max_tokens in 3 of 3 tries. Only the grammar's copy changes; what it allows still fits the schema.
NUMBER_LIMIT, NUMBER_STEP = 10**15, 1e-6
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for the request's one constraint (not yet validated)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else '{"type": "object"}'
        return json_schema_grammar(schema, f"structured_outputs.{kind}")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    if kind == "grammar":
        try:
            lark = any_to_lark(params.grammar)
        except Exception as e:  # noqa: BLE001 - the converter raises its own error types
            raise ValueError(f"structured_outputs.grammar does not parse: {e}") from e
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return structural_tag_grammar(params.structural_tag)


def json_schema_grammar(schema: str, field_name: str) -> str:
    import llguidance

    parsed = json_object(schema, field_name)
    return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(parsed), defaults=dict(JSON_OPTIONS))


def bounded_numbers(schema):
    """A copy of the schema in which every number or integer without bounds gets them (and numbers a decimal
    step), so no number can run on forever."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: bounded_numbers(v) for k, v in value.items()}
        elif key in _VALUES:
            out[key] = value
        else:
            out[key] = bounded_numbers(value)
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if "number" in types or "integer" in types:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_LIMIT
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


def structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text until a
    trigger, then the tag's JSON schema between begin and end."""
    from llguidance import StructTag

    try:
        spec = json.loads(text)
        tags = []
        for s in spec["structures"]:
            trigger = next(t for t in spec["triggers"] if s["begin"].startswith(t))
            tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {}, end=s["end"]))
    except (json.JSONDecodeError, KeyError, TypeError, StopIteration, AssertionError) as e:
        raise ValueError("structured_outputs.structural_tag must be {\"structures\": [{\"begin\", \"schema\", "
                         "\"end\"}], \"triggers\": [...]} with every begin starting with a trigger") from e
    return StructTag.to_grammar(tags)


def validate(params: StructuredOutputsParams, field_name: str = "") -> StructuredOutputsParams:
    """Translate and check the grammar once; raises ValueError naming the field and llguidance's reason."""
    import llguidance

    name = field_name or f"structured_outputs.{params.kind}"
    text = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"{name} is not a valid {params.kind} constraint: {error.strip()}")
    params.grammar_text = text
    return params
