"""The wire contract between the front end and the engine core (msgspec; in-process and over ZMQ)."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams

# (token ids, logprobs, rank of the sampled token) per position: row 0 of ids/logprobs is the sampled token.
LogprobsLists = tuple[list[list[int]], list[list[float]], list[int]]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    deadline: float | None = None   # time.time() after which the engine aborts it (the request's timeout)
    kv_transfer_params: dict[str, Any] | None = None   # {"remote_address": ...}: pull its prompt's KV from there
    lora_request: LoRARequest | None = None   # the adapter it runs with (None: the base model)
    mm_features: list[MultiModalFeature] | None = None   # its images, in prompt order (a vision model)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    scheduled_time: float = 0.0     # on a request's first output: when it was first scheduled
    pooled: list[float] | None = None   # an embedding request's embedding
    engine_seconds: float = 0.0     # on a request's last output: its share of the engine's step time

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0    # since the previous stats
    prefix_cache_hits: int = 0
    prefix_cache_offload_hits: int = 0   # of the hits, copied back from the KV offload tier
    encoder_items: int = 0           # images through the vision tower since the previous stats
    encoder_cache_hits: int = 0      # images whose embeddings were found in the encoder cache
    encoder_seconds: float = 0.0     # time in the vision tower
    num_preemptions: int = 0         # since the previous stats
    num_prompt_tokens: int = 0       # computed since the previous stats
    num_generation_tokens: int = 0
    spec_num_drafts: int = 0         # verifications of drafts since the previous stats (vLLM's names)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class RequestState(msgspec.Struct):
    """One request as the scheduler holds it, for the live engine view."""
    request_id: str
    status: str                 # "running", "waiting" or "preempted"
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_cached_tokens: int      # prefix-cache hit at its first scheduling (-1 before)
    blocks: list[tuple[int, int]]   # its block table as runs (first block id, count): blocks come out in runs


class EngineState(msgspec.Struct):
    """A snapshot of the scheduler and the KV cache (GET /v1/engine/state): which request owns which blocks,
    which blocks are shared by several, and which free blocks still hold a cached prefix."""
    timestamp: float
    num_blocks: int
    block_size: int
    requests: list[RequestState] = []
    # block-id runs (first, count), sorted: in use by more than one request (a shared prefix), and free but
    # still findable by the prefix cache; a full cache's thousands of ids take a few dozen runs
    shared_blocks: list[tuple[int, int]] = []
    cached_free_blocks: list[tuple[int, int]] = []


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Request ids whose add_request failed in the engine, with the reason.
    errors: dict[str, str] = {}
    # Request ids aborted for running past their deadline or waiting past max_queue_time, with the reason.
    timed_out: dict[str, str] = {}
    state: EngineState | None = None   # when the front end asked for one (STATE)
