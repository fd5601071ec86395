"""The request tracer against the SDK's in-memory exporter: one span per finished request, none for the rest."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams


def test_spans_of_real_requests(smol_llm):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tokenmill.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer("smol", exporter=exporter)
    outs = smol_llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=5, temperature=0, n=2),
                             use_tqdm=False)
    for ro in outs:
        tracer.record(ro)
    unfinished = outs[0]
    unfinished.finished = False
    tracer.record(unfinished)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["llm_request"] * 2
    for span, ro in zip(spans, outs):
        a = span.attributes
        assert a["gen_ai.request.id"] == ro.request_id and a["gen_ai.response.model"] == "smol"
        assert a["gen_ai.usage.completion_tokens"] == 10 and a["gen_ai.request.n"] == 2
        assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert a["tokenmill.engine_seconds"] > 0
