"""The engine core: add/abort requests and `step()` = schedule -> execute_model -> update_from_output.

`run_busy_loop` drives it in its own process for the server; the offline LLM calls `step()` directly.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineState, RequestState
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.executor.base import Executor
from tokenmill.profiling import StepProfile
from tokenmill.utils import format_bytes, init_logger

logger = init_logger(__name__)

# What one idle pre-fault call writes of the KV cache (~13 ms at a VM's first-touch rate): the longest a request
# arriving meanwhile waits for it.
PREFAULT_BYTES = 8 << 20
# The pre-fault ahead of the blocks handed out (prefault_ahead) keeps the blocks the next step can take written above
# the high-water mark, writing at least this many at a time: a step writes about what the steps before it took.
PREFAULT_AHEAD_MIN_BLOCKS = 16
# The warm-up request's prompt: enough to build every kernel path a first request takes.
WARMUP_TOKENS = 256
# ... and where it calibrates a quantized KV cache, its prompt is the calibration text (up to this many tokens),
# however many steps that takes
CALIBRATION_TOKENS = 512


def block_runs(ids) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]: runs of consecutive block ids, in the given order."""
    a = np.asarray(ids, dtype=np.int64)
    if not len(a):
        return []
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(a)])))
    return list(zip(a[starts].tolist(), counts.tolist()))


def warm_up_prompt(model_config, vocab_size: int, length: int, calibrate: bool) -> list[int]:
    """The warm-up's prompt: made-up tokens, or, where its keys calibrate a quantized KV cache (see
    layers/attention.py), the shipped calibration text, at most `length` tokens of it (real text: see
    data/README.md)."""
    if not calibrate:
        return [(17 + i) % vocab_size for i in range(length)]
    from tokenmill.model.tokenizer import load_tokenizer

    text = (Path(__file__).parent / "data" / "kv_calibration.txt").read_text()
    ids = load_tokenizer(model_config.tokenizer)(text).input_ids
    return [i % vocab_size for i in ids[:length]]


def validate_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise ValueError("prompt is empty: it must have at least one token")
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens long, longer than max_model_len "
                         f"({max_model_len} tokens)")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        from tokenmill.structured_output.manager import StructuredOutputManager

        self.config = config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, config.mm_config,
                                   config.cross_config)
        if executor is None:
            from tokenmill.executor.factory import make_executor

            executor = make_executor(config)
        self.executor = executor
        self.profile = getattr(executor, "profile", None) or StepProfile()
        self.vocab_size = int(config.model_config.hf_config.vocab_size)
        self.structured_output = StructuredOutputManager(config.model_config, self.vocab_size)
        self.waiting_for_grammar: dict[str, tuple[Request, Future]] = {}
        self.waiting_for_kv: dict[str, tuple[Request, Future]] = {}   # pulling prompt blocks from a prefill instance
        # each request's share of engine time so far: per step, its scheduled tokens over the step's, times the
        # step's seconds (what --cost-per-hour prices)
        self.engine_seconds: collections.Counter[str] = collections.Counter()
        self._watch_deadlines = False
        self.checked_loras: set[tuple[int, str]] = set()
        self.kv_connector = None
        self._prefault_next = 1   # the next KV block a pre-fault writes (None: done, or not this executor's)
        self._prefault_bytes, self._prefault_seconds = 0, 0.0   # for the idle pre-fault's closing log line
        sc = config.scheduler_config   # the most blocks any step can take (_blocks_next_step's bound)
        self._max_step_blocks = -(-sc.max_num_batched_tokens // config.cache_config.block_size) + sc.max_num_seqs
        self._warm_up()
        if config.kv_transfer_config is not None:
            from tokenmill.kv_transfer.connector import KVConnector

            runner = getattr(executor, "runner", None)
            if runner is None:
                raise ValueError("kv_transfer_config needs the model in the engine process (one rank)")
            self.kv_connector = KVConnector(config.kv_transfer_config, config, self.scheduler.kv_cache_manager.pool,
                                            runner)

    def _warm_up(self) -> None:
        """One short request through the whole step, so lazy initialisation (thread pools, kernel primitives) is
        not paid by the first user; its traces are then wiped from the cache and the counters. (A warm-up that
        filled a step's whole token budget took 1.4 s of a 6 s start; measured since, a first 2,000-token step
        costs the same after either, ~0.7 s, now that freed activation memory stays in the heap.)"""
        from tokenmill.sampling_params import SamplingParams

        t0 = time.perf_counter()
        sc, cc = self.config.scheduler_config, self.config.cache_config
        calibrate = cc.cache_dtype != "auto"   # the warm-up's keys calibrate a quantized cache: all of them
        length = max(1, min(CALIBRATION_TOKENS if calibrate else min(WARMUP_TOKENS, sc.max_num_batched_tokens),
                            sc.max_model_len - 3, (cc.num_blocks - 1) * cc.block_size))
        prompt = warm_up_prompt(self.config.model_config, self.vocab_size, length, calibrate)
        self.add_request(EngineCoreRequest("tokenmill-warmup", prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                      temperature=0), time.time(),
                                           mm_features=self._warm_up_media()))
        while self.has_unfinished_requests():
            self.step()
        sched = self.scheduler
        sched.kv_cache_manager.pool.reset_prefix_cache()
        sched.make_stats()
        sched.num_preemptions = sched.peak_blocks_in_use = sched.peak_num_running = 0
        sched.peak_token_share = 0.0
        self.profile.reset()
        logger.info("warm-up step done in %.2f s (%d tokens)", time.perf_counter() - t0, len(prompt))

    def _warm_up_media(self):
        """An encoder-decoder model's warm-up takes its encoder through a window of silence too."""
        if self.config.cross_config is None:
            return None
        from tokenmill.multimodal.audio import silence_feature

        hf = self.config.model_config.hf_config
        return [silence_feature(hf.num_mel_bins, 2 * hf.max_source_positions)]

    def prefault_idle_kv(self) -> bool:
        """Called while no request is waiting or running: write the next ~8 MiB of the KV cache's never-used
        blocks (the free queue hands them out in id order), so the first requests after a start do not pay the
        first touch of each page (~0.6 GB/s in this project's VMs, ~6% of W4's time; vLLM zeroes its whole cache
        at start instead, 2-7 s for 4 GiB here). True while blocks remain."""
        if self._prefault_next is None:
            return False
        cc = self.config.cache_config
        block_bytes = max(1, cc.kv_bytes_per_token(self.config.model_config) * cc.block_size)
        start = max(self._prefault_next, self.scheduler.kv_cache_manager.pool.high_water + 1)
        t0 = time.perf_counter()
        written = self._prefault_through(start + max(1, PREFAULT_BYTES // block_bytes))
        self._prefault_bytes += written * block_bytes
        self._prefault_seconds += time.perf_counter() - t0
        if not written and self._prefault_bytes:
            logger.info("KV cache: %s of untouched pages written while idle, in %.1f s",
                        format_bytes(self._prefault_bytes), self._prefault_seconds)
        return written > 0

    def prefault_ahead(self) -> None:
        """Before each step: keep the blocks this step can take written above the highest block ever handed out (the
        idle pre-fault goes on from the same point), so that the step's K/V writes land on backed pages. Where a
        page's first write happened inside the forward instead (rows of scattered blocks from both threads, some
        after a read had mapped the zero page: a copy and a TLB shootdown), W1's first run in a process took
        19-22 s against 15.6-16.1 s for the next; with this, 17.4-18.9 s against 18.7-21.6 in fresh processes,
        1.4-2.2 s of it in this phase (e4626e1:docs/benchmarks/2026-12-04-w3-decode)."""
        if self._prefault_next is None:
            return
        high = self.scheduler.kv_cache_manager.pool.high_water + 1
        if self._prefault_next >= high + self._max_step_blocks:
            return   # ahead of any step (as the idle pre-fault leaves it): no look at the requests
        want = high + self._blocks_next_step()
        if self._prefault_next >= want:
            return
        with self.profile.phase("prefault_kv"):
            self._prefault_through(max(want, self._prefault_next + PREFAULT_AHEAD_MIN_BLOCKS))

    def _blocks_next_step(self) -> int:
        """At most the blocks the next step hands out: its prompt tokens (the token budget at most) fill whole
        blocks, and each request it runs may start one more. (A bound for the whole budget and max_num_seqs wrote
        ~140 MB that W3 never used: the first write to a page is the cost this saves.)"""
        sched, sc = self.scheduler, self.config.scheduler_config
        if len(sched.waiting):
            prompt_tokens = sc.max_num_batched_tokens
        else:   # only running requests still in their prompts (chunked prefill) take prompt tokens
            prompt_tokens = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        block_size = self.config.cache_config.block_size
        return (-(-min(prompt_tokens, sc.max_num_batched_tokens) // block_size)
                + min(sc.max_num_seqs, len(sched.running) + len(sched.waiting)))

    def _prefault_through(self, end: int) -> int:
        """Write the never-used blocks from where the pre-faults stand up to `end` (the pool's end at most); how
        many it wrote. Past the pool's end, or where the executor does not pre-fault, it stops for good; a range
        with nothing in it (the blocks handed out already reach `end`) is only nothing to do now."""
        pool = self.scheduler.kv_cache_manager.pool
        start = max(self._prefault_next, pool.high_water + 1)   # never a block a request has had
        end = min(end, pool.num_blocks + 1)
        if start >= end:
            if start > pool.num_blocks:
                self._prefault_next = None
            return 0
        if not self.executor.prefault_kv(start, end):
            self._prefault_next = None
            return 0
        self._prefault_next = end
        return end - start

    def add_request(self, req: EngineCoreRequest) -> None:
        max_model_len = self.config.scheduler_config.max_model_len
        validate_prompt_length(len(req.prompt_token_ids), max_model_len)
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token id(s) {bad[:5]} outside the vocabulary of {self.vocab_size}")
        sp = req.sampling_params
        sp.update_from_model(self.config.model_config.eos_token_ids, self.vocab_size)
        room = max_model_len - len(req.prompt_token_ids)
        max_tokens = min(sp.max_tokens, room) if sp.max_tokens is not None else room
        if req.lora_request is not None:
            self._check_lora(req.lora_request)
        if req.mm_features:
            self._check_media(req)
        request = Request(req.request_id, req.prompt_token_ids, sp, max(max_tokens, 1),
                          self.config.cache_config.block_size, req.arrival_time, req.priority, req.cache_salt,
                          req.lora_request, req.mm_features)
        request.deadline = req.deadline
        self._watch_deadlines |= req.deadline is not None
        address = (req.kv_transfer_params or {}).get("remote_address")
        if address:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params: this instance was started without --kv-transfer-config")
            pull = self.kv_connector.start_pull(request.block_hashes, request.num_tokens, address)
            if pull is not None:   # the request joins the scheduler when its prompt's blocks are here
                self.waiting_for_kv[req.request_id] = (request, pull)
                return
        self._admit(request)

    def _check_media(self, req: EngineCoreRequest) -> None:
        mm = self.config.mm_config
        if self.config.cross_config is not None:
            if len(req.mm_features) != 1 or req.mm_features[0].modality != "audio":
                raise ValueError("a request to a speech model carries one audio window (multi_modal_data audio)")
            return
        if mm is None:
            raise ValueError("this model takes no images (it has no vision tower)")
        n = len(req.prompt_token_ids)
        for f in req.mm_features:
            if not 0 <= f.offset < f.end <= n:
                raise ValueError(f"an image's placeholders [{f.offset}, {f.end}) fall outside the prompt of {n}")
            if f.length > mm.encoder_cache_tokens:
                raise ValueError(f"an image of {f.length} embeddings is larger than the encoder cache "
                                 f"({mm.encoder_cache_tokens})")

    def _check_lora(self, lora) -> None:
        """An adapter is checked against the model once (its config and tensor shapes), before any request runs it."""
        from tokenmill.lora.adapter import read_adapter

        lora_config = self.config.lora_config
        if lora_config is None:
            raise ValueError(f"lora_request {lora.lora_name!r}: this engine was started without enable_lora")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self.checked_loras:
            read_adapter(lora.lora_path, self.config.model_config.hf_config, lora_config.max_lora_rank)
            self.checked_loras.add(key)

    def _admit(self, request: Request) -> None:
        grammar = self.structured_output.grammar_for(request.request_id, request.sampling_params)
        if isinstance(grammar, Future):   # compiling: the request joins the scheduler when its grammar is ready
            self.waiting_for_grammar[request.request_id] = (request, grammar)
            return
        request.grammar = grammar
        self.scheduler.add_request(request)

    def _finished(self, pending: dict[str, tuple[Request, Future]]) -> list[tuple[str, Request, Future]]:
        """The requests of `pending` whose background work (a grammar, a KV pull) is done, taken out of it; with
        nothing else to run, it first waits a little for one."""
        if pending and not self.scheduler.has_unfinished_requests():
            wait([f for _, f in pending.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        done = [(rid, request, future) for rid, (request, future) in pending.items() if future.done()]
        for rid, _, _ in done:
            del pending[rid]
        return done

    def _admit_transferred(self) -> dict[str, str]:
        """Requests whose prompt blocks arrived: the blocks go into the prefix cache, the request to the scheduler
        (or to its grammar). A producer that did not answer costs only time: the prompt is computed here. A block
        layout that differs fails the request. With nothing else to run, wait a little for a pull."""
        errors = {}
        for rid, request, future in self._finished(self.waiting_for_kv):
            try:
                self.kv_connector.install(future.result())
            except ValueError as e:
                errors[rid] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 - a producer gone or late: compute the prompt instead
                logger.warning("request %s: no KV blocks from the prefill instance (%s: %s); computing its prompt "
                               "here", rid, type(e).__name__, e)
            try:
                self._admit(request)
            except ValueError as e:
                errors[rid] = str(e)
        return errors

    def _admit_compiled(self) -> dict[str, str]:
        """Requests whose grammar finished compiling go to the scheduler; a grammar that failed fails its request
        (the error goes back in the step's outputs). With nothing else to run, wait a little for one."""
        errors = {}
        for rid, request, future in self._finished(self.waiting_for_grammar):
            try:
                request.grammar = future.result()
            except ValueError as e:
                errors[rid] = str(e)
                continue
            self.scheduler.add_request(request)
        return errors

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        for rid in request_ids:
            self.waiting_for_grammar.pop(rid, None)
            self.waiting_for_kv.pop(rid, None)
            self.engine_seconds.pop(rid, None)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.waiting_for_grammar) or bool(self.waiting_for_kv)

    def _expire(self) -> dict[str, str]:
        """Abort requests past their deadline, and requests never scheduled that waited past max_queue_time; their
        blocks are freed now and the reason goes back to the front end."""
        limit = self.config.scheduler_config.max_queue_time
        if limit is None and not self._watch_deadlines:
            return {}
        now = time.time()
        expired: dict[str, str] = {}
        candidates = [*self.scheduler.requests.values(),
                      *(r for r, _ in [*self.waiting_for_grammar.values(), *self.waiting_for_kv.values()])]
        for req in candidates:
            if req.deadline is not None and now > req.deadline:
                expired[req.request_id] = (f"the request timed out: {req.deadline - req.arrival_time:.1f} s allowed, "
                                           f"{req.num_output_tokens} tokens generated")
            elif limit is not None and req.first_scheduled_time == 0.0 and now - req.arrival_time > limit:
                expired[req.request_id] = (f"the request waited {now - req.arrival_time:.1f} s in the queue, more "
                                           f"than max_queue_time ({limit:g} s); the server is overloaded")
        if expired:
            self.abort_requests(list(expired))
        return expired

    def step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        timed_out = self._expire()
        if self.kv_connector is not None:
            self.kv_connector.serve()
        errors = {**self._admit_transferred(), **self._admit_compiled()}
        self.prefault_ahead()
        with self.profile.phase("schedule"):
            so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0:
            self.profile.idle()
            if so.finished_req_ids or so.kv_offload:  # the runner drops finished requests, copies offloaded blocks
                self.executor.execute_model(so)
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time(),
                                     errors=errors, timed_out=timed_out)
        with self.profile.phase("grammar_bitmask"):
            so.grammar_bitmask = self.structured_output.grammar_bitmask(
                so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, self.scheduler.requests)
        result = self.executor.execute_model(so)
        with self.profile.phase("update_from_output"):
            outputs = self.scheduler.update_from_output(so, result)
        self.profile.steps += 1
        self._charge(so.num_scheduled_tokens, so.total_num_scheduled_tokens, time.perf_counter() - start, outputs)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(), timestamp=time.time(),
                                 errors=errors, timed_out=timed_out)

    def _charge(self, tokens: dict[str, int], total: int, seconds: float, outputs: list) -> None:
        """Split the step's time over its requests by their tokens; a finished request's total goes out with it."""
        per_token = seconds / total
        for rid, n in tokens.items():
            self.engine_seconds[rid] += n * per_token
        for out in outputs:
            if out.finish_reason is not None:
                out.engine_seconds = self.engine_seconds.pop(out.request_id, 0.0)

    def snapshot(self) -> EngineState:
        """The live engine view: requests with their progress and blocks, shared and cached free blocks. A few
        hundred requests and a pass over the cached blocks: ~1 ms, taken between steps when asked."""
        sched = self.scheduler
        kv = sched.kv_cache_manager
        pool = kv.pool
        status = {RequestStatus.RUNNING: "running", RequestStatus.WAITING: "waiting",
                  RequestStatus.PREEMPTED: "preempted"}
        requests = [RequestState(r.request_id, status.get(r.status, "waiting"), r.num_prompt_tokens,
                                 r.num_computed_tokens, r.num_output_tokens, r.max_tokens, r.num_cached_tokens,
                                 block_runs(kv.get_block_ids(r.request_id)))
                    for r in sched.requests.values() if r.request_id != "tokenmill-warmup"]
        cached = list(pool.cached.values())
        return EngineState(time.time(), pool.num_blocks, kv.block_size, requests,
                           block_runs(np.sort([b.block_id for b in cached if b.ref_cnt > 1])),
                           block_runs(np.sort([b.block_id for b in cached if b.ref_cnt == 0])))

    def serve_kv(self) -> None:
        """Answer KV pulls from decode instances (the engine loop calls it when their socket wakes it)."""
        if self.kv_connector is not None:
            self.kv_connector.serve()

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.shutdown()
