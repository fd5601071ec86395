"""Prometheus metrics under `tokenmill:` (named after vLLM's) and a periodic log line while busy."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.messages import EngineCoreOutputs
from tokenmill.engine.output_processor import IterationStats
from tokenmill.spec_decode.metrics import SpecDecodingTotals
from tokenmill.utils import init_logger

logger = init_logger(__name__)

_COST_BUCKETS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, cost_per_hour: float | None = None):
        self.registry = registry or CollectorRegistry()
        self.cost_per_hour = cost_per_hour
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"tokenmill:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(f"tokenmill:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.offload_hits = counter("prefix_cache_offload_hits", "Of the prefix-cache hits, prompt tokens copied back "
                                    "from the KV offload tier (beyond the KV cache's memory).")
        self.encoder_items = counter("encoder_items", "Images through the vision tower (the encoder stage).")
        self.encoder_hits = counter("encoder_cache_hits", "Images whose embeddings the encoder cache already held.")
        self.encoder_seconds = counter("encoder_seconds", "Time in the vision tower.")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV-cache blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = Counter("tokenmill:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of speculative drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.",
                                             ["model_name", "position"], registry=self.registry)
        self.model_name = model_name
        self.cost = Histogram("tokenmill:request_cost_usd", "A finished request's share of the machine's cost "
                              "(--cost-per-hour times its share of engine time).", labels, buckets=_COST_BUCKETS,
                              registry=self.registry).labels(model_name) if cost_per_hour is not None else None
        self.log = StatLogger(cost_per_hour=cost_per_hour)

    def record_output(self, ro) -> None:
        if self.cost is not None and ro.finished and ro.metrics is not None:
            self.cost.observe(ro.metrics.engine_seconds * self.cost_per_hour / 3600)

    def record_engine(self, outputs: EngineCoreOutputs) -> None:
        s = outputs.scheduler_stats
        if s is None:
            return
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.prefix_queries.inc(s.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits)
        self.offload_hits.inc(s.prefix_cache_offload_hits)
        if s.encoder_items or s.encoder_cache_hits or s.encoder_seconds:
            self.encoder_items.inc(s.encoder_items)
            self.encoder_hits.inc(s.encoder_cache_hits)
            self.encoder_seconds.inc(s.encoder_seconds)
        self.preemptions.inc(s.num_preemptions)
        self.prompt_tokens.inc(s.num_prompt_tokens)
        self.generation_tokens.inc(s.num_generation_tokens)
        if s.spec_num_drafts:
            self.spec_drafts.inc(s.spec_num_drafts)
            self.spec_draft_tokens.inc(s.spec_num_draft_tokens)
            self.spec_accepted.inc(s.spec_num_accepted_tokens)
            for pos, n in enumerate(s.spec_accepted_per_pos):
                self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(n)
        self.log.record(s)

    def record_frontend(self, stats: IterationStats) -> None:
        for v in stats.ttfts:
            self.ttft.observe(v)
        for v in stats.itls:
            self.itl.observe(v)
        for reason, e2e, queued, _, _ in stats.finished:
            self.success.labels(self.model_name, reason).inc()
            self.e2e.observe(e2e)
            self.queue_time.observe(queued)


class StatLogger:
    """Every few seconds while there is work: throughput, batch, KV usage and prefix hit rate, like vLLM."""

    def __init__(self, interval: float = 5.0, cost_per_hour: float | None = None):
        self.interval = interval
        self.cost_per_hour = cost_per_hour
        self.last = time.monotonic()
        self.prompt = self.gen = self.queries = self.hits = 0
        self.latest = None
        self.spec = SpecDecodingTotals()

    def record(self, s) -> None:
        self.prompt += s.num_prompt_tokens
        self.gen += s.num_generation_tokens
        self.queries += s.prefix_cache_queries
        self.hits += s.prefix_cache_hits
        self.spec.add(s)
        self.latest = s
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        elapsed, busy = now - self.last, self.prompt or self.gen or s.num_running_reqs or s.num_waiting_reqs
        if busy:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        self.prompt / elapsed, self.gen / elapsed, s.num_running_reqs, s.num_waiting_reqs,
                        100 * s.kv_cache_usage, 100 * self.hits / self.queries if self.queries else 0.0)
            if self.spec.num_drafts:
                logger.info("SpecDecoding metrics: %s", self.spec.describe())
            if self.cost_per_hour is not None and self.gen:   # the machine's cost over what it produced meanwhile
                logger.info("Cost: %.4f USD per million output tokens", self.cost_per_hour * elapsed / 3600
                            / self.gen * 1e6)
        self.spec = SpecDecodingTotals()
        self.last = now
        self.prompt = self.gen = self.queries = self.hits = 0
