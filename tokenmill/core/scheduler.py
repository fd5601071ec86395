"""Continuous batching with a token budget per step.

There are no phases, only counters: each step every running request is handed
`num_tokens - num_computed_tokens` tokens (capped by the budget), so decodes, prompt chunks and
recomputation after preemption all fall out of the same loop. Running requests go first, then waiting
ones while budget, sequence slots and free KV blocks for the whole of each last (a prompt is admitted a chunk at
a time, but only once all of it fits). While some requests decode, the prompt tokens of a step
are capped (prefill_tokens_while_decoding), so a decode never waits behind a whole budget of prompt work (a
2,048-token chunk is ~0.8 s on 2 cores; W4's inter-token p99 was that step). When blocks run out, the
lowest-priority (or newest) running request is preempted: its blocks go back and it is recomputed later; nothing
is dropped. Speculative drafts are more of the same: a request's `spec_token_ids` are scheduled as extra tokens, and
after verification the computed count steps back over the rejected ones, whose slots are given back.
"""

from __future__ import annotations

import time

from tokenmill.config import CacheConfig, CrossAttentionConfig, MultiModalConfig, SchedulerConfig
from tokenmill.core.cross_attention import CrossAttentionSlots
from tokenmill.core.encoder_cache import EncoderCacheManager
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_offload import OffloadIndex
from tokenmill.core.request_queue import make_queue
from tokenmill.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenmill.engine.messages import EngineCoreOutput, SchedulerStats
from tokenmill.engine.request import Request, RequestStatus, check_stop, unsent_prompt_logprobs


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 mm_config: MultiModalConfig | None = None, cross_config: CrossAttentionConfig | None = None):
        self.config = scheduler_config
        # the encoder stage: a vision model's range of a prompt reaches an image only once its embeddings are
        # there; an encoder-decoder model's prompt starts once its encoder output has a cross-attention slot
        self.encoder: EncoderCacheManager | CrossAttentionSlots | None = None
        if mm_config is not None:
            self.encoder = EncoderCacheManager(mm_config.encoder_cache_tokens, mm_config.encoder_budget_tokens)
        elif cross_config is not None:
            self.encoder = CrossAttentionSlots(cross_config.num_slots, cross_config.encoder_budget_tokens,
                                               cross_config.source_positions)
        self.block_size = cache_config.block_size
        offload = (OffloadIndex(cache_config.offload_blocks, cache_config.offload_disk_blocks)
                   if cache_config.offload_blocks else None)
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, offload)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.kept_block_ids: dict[str, int] = {}   # requests whose rejected drafts gave blocks back since last step
        self.num_preemptions = 0
        self._stats = SchedulerStats()
        self.peak_blocks_in_use = 0
        self.peak_num_running = 0  # most requests running in one step (W5: how many fit the KV cache)
        # at the peak of blocks in use: tokens of the running requests per allocated slot (the share of KV memory
        # holding real tokens; above 1 when requests share prefix blocks)
        self.peak_token_share = 0.0

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Abort or stop requests from outside (client gone, stop string found); unknown ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        self.kept_block_ids.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        spec: dict[str, list[int]] = {}
        displaced: list[Request] = []
        if self.config.policy == "priority":   # the most urgent first, so the budget and the blocks go to them
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
            displaced = self._displace_for_waiting()
        budget, prompt_budget = self._schedule_running(budget, self._prompt_tokens_allowed(), num_scheduled,
                                                       new_blocks, preempted, spec)
        admitted: list[Request] = []
        if not preempted:
            self._schedule_waiting(budget, prompt_budget, num_scheduled, admitted)
        return self._build_output(num_scheduled, new_blocks, admitted, displaced + preempted, spec)

    def _prompt_tokens_allowed(self) -> int:
        """Prompt tokens this step may compute: the cap while any running request is decoding (its next token is
        its only uncomputed one), else no limit beyond the step's budget."""
        cap = self.config.prefill_tokens_while_decoding
        if cap > 0 and any(r.num_tokens - r.num_computed_tokens <= 1 for r in self.running):
            return cap
        return self.config.max_num_batched_tokens

    def _schedule_running(self, budget: int, prompt_budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], preempted: list[Request],
                          spec: dict[str, list[int]]) -> tuple[int, int]:
        """Tokens for the running requests; returns what is left of the step's budget and of its prompt budget."""
        i = 0
        lookahead = self.config.num_lookahead_tokens
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            encode: list[int] = []
            if remaining > 1:   # a prompt (or its recomputation): its chunk counts against the prompt budget
                num_new = min(self._prompt_chunk(remaining), budget, prompt_budget)
                num_new, encode = self._media_plan(req, req.num_computed_tokens, num_new)
                prompt = num_new
            else:               # a decode: its token and drafts
                num_new, prompt = min(remaining + self._num_useful_drafts(req), budget), 0
            if num_new <= 0:
                i += 1
                continue
            blocks = self.kv_cache_manager.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
            while blocks is None:
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                blocks = self.kv_cache_manager.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
            if blocks is None:
                break  # the request itself was preempted: no room for anything after it either
            if req.mm_features and self.encoder is not None:
                self.encoder.commit(req, req.num_computed_tokens, num_new, encode)
            num_scheduled[req.request_id] = num_new
            prompt_budget -= prompt
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            num_drafts = req.num_computed_tokens + num_new - req.num_tokens
            if num_drafts > 0:
                spec[req.request_id] = req.spec_token_ids[:num_drafts]
            req.spec_token_ids = []
            budget -= num_new
            i += 1
        return budget, prompt_budget

    def _media_plan(self, req: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """A prompt chunk cut before the first image whose embeddings the encoder cannot have ready this step,
        and the request's items to encode (see core/encoder_cache.py); a text request's chunk as it is."""
        if not req.mm_features or self.encoder is None:
            return num_new, []
        return self.encoder.plan(req, start, num_new)

    def _prompt_chunk(self, num_new: int) -> int:
        """A request's new tokens for this step, capped at long_prefill_token_threshold (vLLM's name) when set."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap > 0 else num_new

    def _num_useful_drafts(self, req: Request) -> int:
        """Drafts past the request's last allowed token are not verified: k drafts can yield k + 1 tokens."""
        if not req.spec_token_ids:
            return 0
        room = min(req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens) - 1
        return max(0, min(len(req.spec_token_ids), room))

    def _pick_victim(self, first: int) -> Request:
        """Only requests not yet scheduled this step are candidates, so no half-made step is undone."""
        candidates = self.running[first:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        self.kept_block_ids.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._stats.num_preemptions += 1
        self.waiting.prepend(req)

    def _displace_for_waiting(self) -> list[Request]:
        """Priority policy: while the first waiting request is short of a sequence slot, of KV room for all of
        it, or of the step's token budget, preempt the lowest-priority running request, but only one of strictly
        lower priority (a larger value), so equals never displace each other and the victims are recomputed
        later (their full blocks stay in the prefix cache). Returns the requests preempted."""
        displaced: list[Request] = []
        while len(self.waiting) and self.running:
            head = self.waiting.peek()
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            if victim.priority <= head.priority or not self._lora_fits(head) or self._fits_now(head):
                break
            self._preempt(victim)
            displaced.append(victim)
        return displaced

    def _lora_fits(self, req: Request) -> bool:
        lora = req.lora_request
        if lora is None:
            return True
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in loras or len(loras) < self.config.max_loras

    def _fits_now(self, req: Request) -> bool:
        """Whether a waiting request would be admitted with its whole first chunk beside what is running."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(req, count=False)
        if not self.kv_cache_manager.has_room(req, computed_blocks):
            return False
        demand = sum(self._step_demand(r) for r in self.running)
        need = min(self._prompt_chunk(req.num_tokens - num_computed), self._prompt_tokens_allowed())
        return self.config.max_num_batched_tokens - demand >= need

    def _step_demand(self, req: Request) -> int:
        """The tokens a running request asks of a step: its prompt chunk, or its decode token and drafts."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining > 1:
            return self._prompt_chunk(remaining)
        return remaining + self._num_useful_drafts(req)

    def _schedule_waiting(self, budget: int, prompt_budget: int, num_scheduled: dict[str, int],
                          admitted: list[Request]) -> None:
        kv = self.kv_cache_manager
        loras: set[int] | None = None   # adapters running, gathered when a waiting request has one
        skipped: list[Request] = []   # their adapter would be one more than max_loras: they wait for a slot
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            lora = req.lora_request
            if lora is not None:
                if loras is None:
                    loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                if lora.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.pop())
                    continue
            computed_blocks, num_computed = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(self._prompt_chunk(num_new), budget, prompt_budget)
            num_new, encode = self._media_plan(req, num_computed, num_new)
            if num_new <= 0:
                break
            # the whole request must fit, not only its first chunk: admitted on a chunk's room, its later chunks
            # find no free blocks, and preemption throws computed work away (W5: 24 preemptions against 21)
            if not kv.has_room(req, computed_blocks):
                break
            if kv.allocate_slots(req, num_new, computed_blocks, num_computed,
                                 self.config.num_lookahead_tokens) is None:
                break
            self.waiting.pop()
            self.running.append(req)
            if req.mm_features and self.encoder is not None:
                self.encoder.commit(req, num_computed, num_new, encode)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
                req.first_scheduled_time = time.time()
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            prompt_budget -= num_new
            admitted.append(req)
            if lora is not None:   # (loras was gathered above)
                loras.add(lora.lora_int_id)
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _build_output(self, num_scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                      admitted: list[Request], preempted: list[Request],
                      spec: dict[str, list[int]]) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [NewRequestData(r.request_id, list(r.all_token_ids), r.num_prompt_tokens, r.sampling_params,
                                   kv.get_block_ids(r.request_id), r.num_computed_tokens, r.lora_request,
                                   r.mm_features or None)
                    for r in admitted]
        kept = self.kept_block_ids
        cached = [CachedRequestData(rid, blocks, self.requests[rid].num_computed_tokens, kept.pop(rid, -1))
                  for rid, blocks in new_blocks.items()]
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            req.status = RequestStatus.RUNNING
            if req.mm_features and self.encoder is not None:
                self.encoder.passed(req)
        out = SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                              finished_req_ids=self.finished_req_ids,
                              preempted_req_ids={r.request_id for r in preempted},
                              scheduled_spec_decode_tokens=spec)
        if kv.offload is not None:
            out.kv_offload = kv.offload.take_ops()
        if self.encoder is not None:
            out.scheduled_encoder_inputs, out.free_encoder_ids = self.encoder.take_step()
        self.finished_req_ids = set()
        self._track_peak()
        return out

    def _track_peak(self) -> None:
        pool = self.kv_cache_manager.pool
        in_use = pool.num_blocks - pool.num_free_blocks
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        if in_use > self.peak_blocks_in_use:
            self.peak_blocks_in_use = in_use
            self.peak_token_share = sum(r.num_computed_tokens for r in self.running) / (in_use * self.block_size)

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        self._stats.encoder_seconds += result.encoder_seconds
        for idx, rid in enumerate(result.req_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            new_ids = result.sampled_token_ids[idx]
            first_pos = req.num_computed_tokens - sched.num_scheduled_tokens.get(rid, 0)
            num_rejected = self._verified(req, sched.scheduled_spec_decode_tokens.get(rid), new_ids)
            self._count_tokens(req, sched.num_scheduled_tokens.get(rid, 0), num_rejected)
            prompt_lp = result.prompt_logprobs.get(rid)
            if prompt_lp is not None:
                prompt_lp = unsent_prompt_logprobs(req, prompt_lp, first_pos)
            if not new_ids and prompt_lp is None:
                continue
            n = 0
            for tok in new_ids:
                n += 1
                req.append_output_token_ids(tok)
                if check_stop(req, tok, self.config.max_model_len):
                    break
            logprobs = result.logprobs.get(rid)
            if n < len(new_ids):  # a stop among accepted drafts: what follows it was never said
                new_ids = new_ids[:n]
                logprobs = logprobs and (logprobs[0][:n], logprobs[1][:n], logprobs[2][:n])
            if req.grammar is not None and not req.status.finished:
                req.grammar.accept(new_ids)
            if rid in result.spec_token_ids and not req.status.finished:
                drafts = result.spec_token_ids[rid]
                req.spec_token_ids = drafts[:req.grammar.num_valid(drafts)] if req.grammar is not None else drafts
            out = EngineCoreOutput(rid, new_ids, new_logprobs=logprobs,
                                   new_prompt_logprobs=prompt_lp, num_cached_tokens=max(req.num_cached_tokens, 0),
                                   scheduled_time=req.first_scheduled_time if req.num_output_tokens <= len(new_ids)
                                   else 0.0, pooled=result.pooled.get(rid))
            if req.status.finished:
                out.finish_reason, out.stop_reason = req.status.finish_reason, req.stop_reason
                self.running.remove(req)
                self._free(req)
            outputs.append(out)
        return outputs

    def _verified(self, req: Request, drafts: list[int] | None, new_ids: list[int]) -> int:
        """Steps the computed count back over the rejected drafts, gives their slots back and counts acceptance;
        returns how many were rejected."""
        if not drafts:
            return 0
        num_accepted = max(len(new_ids) - 1, 0)
        num_rejected = len(drafts) - num_accepted
        req.num_computed_tokens -= num_rejected
        s = self._stats
        s.spec_num_drafts += 1
        s.spec_num_draft_tokens += len(drafts)
        s.spec_num_accepted_tokens += num_accepted
        if len(s.spec_accepted_per_pos) < len(drafts):
            s.spec_accepted_per_pos.extend([0] * (len(drafts) - len(s.spec_accepted_per_pos)))
        for pos in range(num_accepted):
            s.spec_accepted_per_pos[pos] += 1
        if num_rejected:
            kept = self.kv_cache_manager.trim(req, req.num_tokens + len(new_ids) + self.config.num_lookahead_tokens)
            if kept is not None:
                self.kept_block_ids[req.request_id] = kept
        return num_rejected

    def _count_tokens(self, req: Request, n: int, num_rejected: int = 0) -> None:
        prompt_part = max(0, min(n, req.num_prompt_tokens - (req.num_computed_tokens + num_rejected - n)))
        self._stats.num_prompt_tokens += prompt_part
        self._stats.num_generation_tokens += n - prompt_part - num_rejected

    def make_stats(self) -> SchedulerStats:
        stats, self._stats = self._stats, SchedulerStats()
        prefix = self.kv_cache_manager.take_stats()
        stats.num_running_reqs, stats.num_waiting_reqs = len(self.running), len(self.waiting)
        stats.kv_cache_usage = self.kv_cache_manager.usage
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        stats.prefix_cache_offload_hits = prefix.offload_hits
        if self.encoder is not None:
            stats.encoder_items, stats.encoder_cache_hits = self.encoder.take_counts()
        return stats
