"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one span per finished request, from its arrival to
its end, with vLLM's `gen_ai.*` attribute names for the model, token counts and the queue, prefill, decode and
first-token times. The SDK is an optional extra (`pip install 'tokenmill[otel]'`); spans go out in batches over
OTLP/HTTP (protobuf), off the request path."""

from __future__ import annotations

from tokenmill.outputs import RequestOutput

SPAN_NAME = "llm_request"


class RequestTracer:
    def __init__(self, model_name: str, endpoint: str | None = None, exporter=None):
        """Spans go to `endpoint` (an OTLP/HTTP collector, e.g. http://127.0.0.1:4318/v1/traces), or to `exporter`
        (tests pass the SDK's in-memory one)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'tokenmill[otel]'") \
                from None
        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": "tokenmill"}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenmill")

    def record(self, ro: RequestOutput) -> None:
        """An output observer: a finished request becomes one span with its times as attributes."""
        m = ro.metrics
        if not ro.finished or m is None or m.finished_time is None:
            return
        scheduled = m.first_scheduled_time or m.arrival_time
        first = m.first_token_time or m.finished_time
        attrs = {
            "gen_ai.request.id": ro.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.prompt_tokens": len(ro.prompt_token_ids),
            "gen_ai.usage.completion_tokens": m.num_output_tokens,
            "gen_ai.response.finish_reasons": [str(c.finish_reason) for c in ro.outputs],
            "gen_ai.request.n": len(ro.outputs),
            "gen_ai.latency.time_in_queue": scheduled - m.arrival_time,
            "gen_ai.latency.time_to_first_token": first - m.arrival_time,
            "gen_ai.latency.time_in_model_prefill": first - scheduled,
            "gen_ai.latency.time_in_model_decode": m.finished_time - first,
            "gen_ai.latency.e2e": m.finished_time - m.arrival_time,
            "tokenmill.engine_seconds": m.engine_seconds,
        }
        span = self.tracer.start_span(SPAN_NAME, start_time=int(m.arrival_time * 1e9), attributes=attrs)
        span.end(end_time=int(m.finished_time * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()   # flushes what is batched
