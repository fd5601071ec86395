"""The server's engine: tokenization and detokenization here, the engine core in its own process.

`generate()` is an async iterator of RequestOutputs; leaving it early (a client that disconnects)
aborts the request in the engine at once, so its blocks are freed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import AsyncMPClient, EngineDeadError
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt, child_params
from tokenmill.engine.messages import EngineCoreOutputs, EngineState
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import init_logger

logger = init_logger(__name__)


class RequestTimeoutError(Exception):
    """The request ran past its deadline (`timeout`, --request-timeout) or waited past --max-queue-time."""


class RequestStream:
    """The outputs of one request. Leaving the iteration early aborts it in the engine; a stream that is never
    iterated (its response never started) is forgotten when it is collected. `on_close` callbacks run once,
    whichever way it ends (the server's admission counters)."""

    def __init__(self, engine: AsyncLLM, request_id: str, reqs: list, queue: asyncio.Queue):
        self.engine, self.request_id, self.reqs, self.queue = engine, request_id, reqs, queue
        self.started = self.finished = self.closed = False
        self.on_close: list[Callable[[], None]] = []

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        self.started = True
        try:
            for req in self.reqs:
                await self.engine.client.add_request(req)
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                await self.engine.abort(self.request_id)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for callback in self.on_close:
                callback()

    def __del__(self) -> None:
        if not self.started and not self.closed:
            self.engine.output_processor.abort_request(self.request_id)
            self.close()


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_observers: list[Callable[[EngineCoreOutputs], None]] | None = None,
                 output_observers: list[Callable[[RequestOutput], None]] | None = None, data_parallel_size: int = 1,
                 launch: bool = False):
        """`launch`: start the engine core now (`start()` otherwise), so that it loads while this process loads
        the tokenizer and starts its server (~1-2 s of a cold start)."""
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.client: AsyncMPClient | None = None
        self._launched_at = 0.0
        if launch:
            self._launch()
        try:
            self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        except BaseException:
            if self.client is not None:
                self.client.shutdown()   # not left waiting for requests (a parallel engine's would block the exit)
            raise
        self.input_processor = InputProcessor(config.model_config, self.tokenizer, config.mm_config, config.media)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_observers = stat_observers or []
        self.last_scheduler_stats = None   # the engine's latest SchedulerStats (queue, KV usage), for /load
        self.output_observers = output_observers or []
        self.dead = False
        self._loop_task: asyncio.Task | None = None
        self.on_dead: Callable[[], None] | None = None
        self.last_progress = time.monotonic()   # when the engine last sent outputs (or work last arrived idle)
        self.finish_times: collections.deque[float] = collections.deque(maxlen=256)   # the drain rate
        self._state_waiters: list[tuple[asyncio.Future, list]] = []   # get_state() calls, and the states so far

    def _launch(self) -> None:
        self._launched_at = time.perf_counter()
        if self.data_parallel_size > 1:
            from tokenmill.engine.dp_client import DataParallelClient

            self.client = DataParallelClient(self.config, self.data_parallel_size)
        else:
            self.client = AsyncMPClient(self.config)

    async def start(self) -> None:
        if self.client is None:
            self._launch()
        await self.client.wait_ready()
        seconds = time.perf_counter() - self._launched_at
        if self.data_parallel_size > 1:
            logger.info("%d engine cores ready in %.1f s (data parallel; CPUs %s)", self.data_parallel_size,
                        seconds, " | ".join(c.config.cpu_bind for c in self.client.clients))
        else:
            logger.info("engine core ready in %.1f s", seconds)
        self._loop_task = asyncio.create_task(self._output_loop())

    @property
    def num_unfinished(self) -> int:
        return len(self.output_processor.parents)

    def stalled_for(self) -> float:
        """Seconds since the engine last sent outputs while requests are pending (0 when idle)."""
        return time.monotonic() - self.last_progress if self.output_processor.parents else 0.0

    def generate(self, prompt: ProcessedPrompt, params: SamplingParams, request_id: str, priority: int = 0,
                 timeout: float | None = None) -> RequestStream:
        """Registers the request at once (so it counts against admission bounds before the caller yields, and a
        bad parameter raises here, before any response starts); iterating the stream sends it to the engine.
        `timeout`: seconds from now after which the engine aborts it (RequestTimeoutError)."""
        if self.dead:
            raise EngineDeadError("the engine core is not running")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.time()
        if not self.output_processor.parents:
            self.last_progress = time.monotonic()   # idle until now: the stall clock starts with this request
        child_ids = self.output_processor.add_request(request_id, prompt.prompt, prompt.prompt_token_ids, params,
                                                      now, queue=queue)
        try:
            reqs = [self.input_processor.make_request(cid, prompt, child_params(params, index), now, priority)
                    for index, cid in enumerate(child_ids)]
        except BaseException:
            self.output_processor.abort_request(request_id)
            raise
        if timeout is not None:
            for req in reqs:
                req.deadline = now + timeout
        try:   # a number too large for the wire (seed, priority, top_k...) is the request's fault, found here
            for req in reqs:
                msgspec.msgpack.encode(req)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            self.output_processor.abort_request(request_id)
            raise ValueError(f"request has a value out of range: {e}") from e
        return RequestStream(self, request_id, reqs, queue)

    async def get_state(self, timeout: float = 2.0) -> list[EngineState]:
        """Every engine core's EngineState (one unless data parallel), taken between its steps."""
        if self.dead or self.client is None:
            raise EngineDeadError("the engine core is not running")
        future = asyncio.get_running_loop().create_future()
        self._state_waiters.append((future, []))
        await self.client.request_state()
        return await asyncio.wait_for(future, timeout)

    async def abort(self, request_id: str) -> None:
        ids = self.output_processor.abort_request(request_id)
        if ids and not self.dead:
            await self.client.abort_requests(ids)

    async def _output_loop(self) -> None:
        while True:
            try:
                outputs = await self.client.get_output()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken socket means the engine is gone
                logger.exception("reading engine outputs failed")
                outputs = None
                self.client.proc.kill()
            if outputs is None:
                if not self.client.is_alive:
                    self._engine_died()
                    return
                continue
            self._handle(outputs)

    def _handle(self, outputs: EngineCoreOutputs) -> None:
        self.last_progress = time.monotonic()
        failed = [(cid, ValueError(m)) for cid, m in outputs.errors.items()]
        failed += [(cid, RequestTimeoutError(m)) for cid, m in outputs.timed_out.items()]
        for cid, error in failed:
            entry = self.output_processor.children.get(cid)
            if entry is not None:
                parent = entry[0]
                siblings = [c for c in self.output_processor.abort_request(parent.request_id) if c != cid]
                if siblings:   # the other completions of an n > 1 request stop too
                    asyncio.create_task(self.client.abort_requests(siblings))
                parent.queue.put_nowait(error)
        results, to_abort = self.output_processor.process_outputs(outputs.outputs)
        for parent, ro in results:
            parent.queue.put_nowait(ro)
            if ro.finished:
                self.finish_times.append(time.monotonic())
            for observe in self.output_observers:
                observe(ro)
        if to_abort:
            asyncio.create_task(self.client.abort_requests(to_abort))
        if outputs.state is not None:
            for future, states in self._state_waiters:
                states.append(outputs.state)
                if len(states) == self.data_parallel_size and not future.done():
                    future.set_result(states)
            self._state_waiters = [w for w in self._state_waiters if not w[0].done()]
        if outputs.scheduler_stats is not None:
            self.last_scheduler_stats = outputs.scheduler_stats
        for observe in self.stat_observers:
            observe(outputs)

    def _engine_died(self) -> None:
        self.dead = True
        logger.error("the engine core process died (exit code %s)", self.client.proc.exitcode)
        for parent in list(self.output_processor.parents.values()):
            parent.queue.put_nowait(EngineDeadError("the engine core died"))
        self.output_processor.parents.clear()
        self.output_processor.children.clear()
        if self.on_dead:
            self.on_dead()

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        if self.client:
            self.client.shutdown()
