"""What the scheduler tells the model runner each step: new requests in full once, running ones as diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.kv_offload import OffloadOps
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state starts over)."""
    req_id: str
    token_ids: list[int]          # prompt, plus the outputs so far when resumed
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] | None = None   # its images: the runner encodes those it is told to


@dataclass
class CachedRequestData:
    """Requests that ran last step too: only the blocks added this step and the computed count."""
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_kept_block_ids: int = -1   # >= 0: rejected drafts gave blocks back; keep this many before appending


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)    # finished or aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # draft tokens to verify, per request: they are the last of its scheduled tokens
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    grammar_bitmask: Any = None   # a structured_output GrammarBitmask when constrained requests sample this step
    kv_offload: OffloadOps | None = None   # copies to and from the KV offload tier, done before the forward
    # the encoder stage (vision models): each request's items to encode before the forward (indices into its
    # mm_features), and encoder-cache entries to drop first
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_ids: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request, in the order of `req_ids`; an empty list while a prompt is still chunked.
    Logprobs rows are (token ids, logprobs, rank of the sampled token); prompt logprobs come per prompt chunk."""
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)   # drafts for the next step
    pooled: dict[str, list[float]] = field(default_factory=dict)   # embedding requests whose prompt ended here
    encoder_seconds: float = 0.0   # the step's vision-tower time (the encoder stage)
