"""Grammar compile time for a large JSON schema, and what a cache hit costs, on the embedded model's vocabulary.

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/2026-11-30-structured/grammar_compile.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from tokenmill.model.source import embedded_model_path
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.structured_output.backend import LLGuidanceBackend
from tokenmill.structured_output.grammar_text import validate
from tokenmill.structured_output.params import StructuredOutputsParams


def large_schema(n_sections: int = 12, fields: int = 10) -> dict:
    """An API-style schema: sections of typed fields, enums, patterns, bounded numbers, arrays and $refs."""
    defs = {"address": {"type": "object", "required": ["street", "city", "zip"], "additionalProperties": False,
                        "properties": {"street": {"type": "string", "maxLength": 60}, "city": {"type": "string"},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}}},
            "money": {"type": "object", "required": ["amount", "currency"],
                      "properties": {"amount": {"type": "number", "minimum": 0},
                                     "currency": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}}}}
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "boolean"}, {"enum": ["low", "medium", "high", "critical"]},
             {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 4},
             {"$ref": "#/$defs/address"}, {"$ref": "#/$defs/money"},
             {"type": "string", "format": "date-time"}, {"anyOf": [{"type": "null"}, {"type": "number"}]},
             {"type": "array", "items": {"$ref": "#/$defs/money"}, "maxItems": 3}]
    sections = {}
    for s in range(n_sections):
        props = {f"field_{s}_{f}": kinds[(s + f) % len(kinds)] for f in range(fields)}
        sections[f"section_{s}"] = {"type": "object", "properties": props, "required": list(props)[: fields // 2],
                                    "additionalProperties": False}
    return {"$defs": defs, "type": "object", "properties": sections, "required": list(sections),
            "additionalProperties": False}


def main() -> None:
    tok = load_tokenizer(embedded_model_path())
    t0 = time.perf_counter()
    backend = LLGuidanceBackend(tok, 49152, (2,))
    print(f"tokenizer trie and mask threads, once per engine: {1e3 * (time.perf_counter() - t0):.0f} ms")
    schema = large_schema()
    text = json.dumps(schema)
    print(f"schema: {len(text)} characters, {sum(len(s['properties']) for s in schema['properties'].values())} "
          "leaf fields")
    t0 = time.perf_counter()
    params = validate(StructuredOutputsParams(json=schema))
    print(f"front-end translate + validate: {1e3 * (time.perf_counter() - t0):.1f} ms")
    mask = torch.full((1, (49152 + 31) // 32), -1, dtype=torch.int32)

    def first_mask() -> tuple[float, float]:
        t0 = time.perf_counter()
        g = backend.compile(params.grammar_text)
        t1 = time.perf_counter()
        backend.fill_bitmask([(g, 0, [])], mask)
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)

    c, m = first_mask()
    print(f"miss: compile {c:.1f} ms + first mask {m:.2f} ms")
    hits = [first_mask() for _ in range(20)]
    print(f"hit (median of 20): copy {statistics.median(h[0] for h in hits):.3f} ms + first mask "
          f"{statistics.median(h[1] for h in hits):.2f} ms; stats {backend.stats}")


if __name__ == "__main__":
    main()
