"""Scheduler-side state of one request. Plain Python: the scheduler and KV-cache manager see no tensors."""

from __future__ import annotations

import enum
import time

from tokenmill.core.block_hash import BlockHash, extend_block_hashes
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature, mm_spans
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, block_size: int, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                 mm_features: list[MultiModalFeature] | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []   # proposed drafts, verified when the request is next scheduled
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1       # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0  # prompt positions whose logprobs went out (a resumed request resends)
        self.first_scheduled_time = 0.0
        self.block_size = block_size
        self.grammar = None   # a RequestGrammar when the output is constrained (structured output)
        self.deadline: float | None = None   # time.time() past which the engine aborts it
        self.lora_request = lora_request
        # a salt goes into the first block's hash, so only requests with the same salt share cached blocks
        self.cache_salt = prefix_salt(cache_salt, lora_request)
        self.mm_features = mm_features or []   # its images: the encoder stage computes them when they are reached
        self.mm_spans = mm_spans(mm_features)
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.cache_salt, self.mm_spans)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt,
                                self.mm_spans)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def prefix_salt(cache_salt: str | None, lora_request: LoRARequest | None) -> bytes:
    """What goes into a request's first block hash: its tenant's salt and its adapter (blocks computed with
    another adapter's weights hold other keys and values)."""
    return ((cache_salt.encode() if cache_salt else b"") +
            (lora_request.cache_key() if lora_request is not None else b""))


def check_stop(req: Request, token_id: int, max_model_len: int) -> bool:
    """Whether the token ends the request (its status then says how): the length cap first, then stop tokens."""
    sp = req.sampling_params
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if req.num_output_tokens < sp.min_tokens:
        return False  # the sampler already kept stop tokens out; this is the same rule on the host
    if token_id in sp.all_stop_token_ids:
        req.status = RequestStatus.FINISHED_STOPPED
        req.stop_reason = token_id if token_id in sp.stop_token_ids else None
        return True
    return False


def unsent_prompt_logprobs(req: Request, lp, first_pos: int):
    """A request preempted after (part of) its prompt recomputes the prompt and scores it again: entry j of
    a chunk starting at first_pos scores prompt position first_pos + 1 + j; pass on only those not sent."""
    skip = max(0, req.num_prompt_logprobs_sent - first_pos)
    req.num_prompt_logprobs_sent = max(req.num_prompt_logprobs_sent, first_pos + len(lp[0]))
    return tuple(part[skip:] for part in lp) if skip else lp
