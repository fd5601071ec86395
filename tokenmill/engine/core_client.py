"""The engine core in its own process, reached over ZMQ `ipc://` sockets with msgspec messages.

Front end -> engine: multipart [kind, payload] on a PUSH/PULL pair (ADD, ABORT, SHUTDOWN).
Engine -> front end: msgpack-encoded EngineCoreOutputs on a second PUSH/PULL pair, one per step with work,
and a stats-only one when the engine goes idle (so gauges such as KV usage fall back to zero).
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.process_start import engine_process_context
from tokenmill.utils import init_logger

logger = init_logger(__name__)

ADD, ABORT, SHUTDOWN, READY, STATE = b"ADD", b"ABORT", b"SHUTDOWN", b"READY", b"STATE"
_IDLE_POLL_MS = 1000


class EngineDeadError(RuntimeError):
    pass


def _watch_process(pid: int | None):
    """A file descriptor that polls readable once process `pid` has exited (Linux pidfd), else None."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:   # gone already, or a kernel without pidfds: the parent check still runs
        return None


@dataclass
class _Intake:
    """What one pass over the input socket brought: requests that could not be added fail alone (their errors go
    out with the next outputs), a state request, or the order to stop."""

    had_input: bool = False
    state_asked: bool = False
    shutdown: bool = False
    errors: dict[str, str] = field(default_factory=dict)


_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_ids = msgspec.msgpack.Decoder(list[str]).decode


def _take_messages(inp, core) -> _Intake:
    """Every message waiting on the engine core's input socket, without blocking."""
    intake = _Intake()
    while True:
        try:
            kind, payload = inp.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return intake
        intake.had_input = True
        if kind == SHUTDOWN:
            intake.shutdown = True
            return intake
        if kind == ADD:
            req = _decode_request(payload)
            try:
                core.add_request(req)
            except Exception as e:  # noqa: BLE001 - one bad request fails alone, never the engine
                if not isinstance(e, ValueError):
                    logger.exception("request %s could not be added", req.request_id)
                intake.errors[req.request_id] = str(e)
        elif kind == ABORT:
            core.abort_requests(_decode_ids(payload))
        elif kind == STATE:
            intake.state_asked = True


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, api_pid: int | None = None) -> None:
    """Entry point of the engine-core process: load the model, then the busy loop. It stops when the API
    server (`api_pid`) exits, even killed: forked from a fork server, its parent is that server, not the API."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the API server decides when the engine stops
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.platform import engine_host_cpus, side_cpus

    ctx = zmq.Context()
    # zmq's I/O threads start with the first socket: keep them off the host thread's core (side_cpus says why)
    for cpu in side_cpus(*engine_host_cpus(config.cpu_bind, config.parallel_config.world_size)) or ():
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    core = EngineCore(config)
    out.send_multipart([READY, b""])
    encoder = msgspec.msgpack.Encoder()
    parent = os.getppid()
    api_exit = _watch_process(api_pid)
    kv_socket = core.kv_connector.socket if core.kv_connector is not None else None
    poller = zmq.Poller()
    # a prefill instance wakes for KV pulls as for requests
    for waited in (inp, api_exit, kv_socket):
        if waited is not None:
            poller.register(waited, zmq.POLLIN)
    prefaulting = True
    try:
        while True:
            busy = core.has_unfinished_requests()
            ready = dict(poller.poll(0 if busy or prefaulting else _IDLE_POLL_MS))
            # the API server is gone (a parallel engine is not a daemon process, so its parent check counts too)
            if os.getppid() != parent or (api_exit is not None and api_exit in ready):
                logger.error("the API server process exited: stopping the engine")
                return
            if kv_socket is not None and kv_socket in ready:
                core.serve_kv()
            intake = _take_messages(inp, core) if inp in ready else _Intake()
            if intake.shutdown:
                return
            if core.has_unfinished_requests():
                outputs = core.step()
                outputs.errors.update(intake.errors)
                if intake.state_asked:
                    outputs.state = core.snapshot()
                out.send_multipart([b"OUT", encoder.encode(outputs)])
            elif not intake.had_input:
                prefaulting = core.prefault_idle_kv()   # idle: the KV cache's next untouched pages
            else:
                out.send_multipart([b"OUT", encoder.encode(EngineCoreOutputs(
                    scheduler_stats=core.scheduler.make_stats(), errors=intake.errors, timestamp=time.time(),
                    state=core.snapshot() if intake.state_asked else None))])
    finally:
        core.shutdown()
        if api_exit is not None:
            os.close(api_exit)
        inp.close(linger=0)
        out.close(linger=0)
        ctx.term()


class AsyncMPClient:
    """The front end's handle on the engine-core process."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="tokenmill-")
        base = f"ipc://{self._dir}/{uuid.uuid4().hex[:8]}"
        self.input_addr, self.output_addr = base + "-in", base + "-out"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.receiver = OutputReceiver(self.output, msgspec.msgpack.Decoder(EngineCoreOutputs))
        mp = engine_process_context()
        self.proc = mp.Process(target=run_engine_core, args=(config, self.input_addr, self.output_addr, os.getpid()),
                               name="tokenmill-engine-core",
                               # a daemon may not start processes: the ranks of a parallel engine are its children
                               daemon=config.parallel_config.world_size == 1)
        self.proc.start()

    async def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.output.poll(500):
                kind, _ = await self.output.recv_multipart()
                if kind == READY:
                    return
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine core process exited during start-up (code {self.proc.exitcode})")
        raise EngineDeadError("the engine core did not become ready in time")

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    async def add_request(self, req: EngineCoreRequest) -> None:
        await self.input.send_multipart([ADD, self.encoder.encode(req)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self.input.send_multipart([ABORT, self.encoder.encode(request_ids)])

    async def request_state(self) -> None:
        """Ask for an EngineState: it comes with the engine's next outputs."""
        await self.input.send_multipart([STATE, b""])

    async def get_output(self, timeout_ms: int = 1000) -> EngineCoreOutputs | None:
        """The next outputs, or None after `timeout_ms` with nothing (so the caller can check liveness)."""
        return await self.receiver.get(timeout_ms)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.proc.is_alive():
            try:
                self.input.send_multipart([SHUTDOWN, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(1)
        self.receiver.close()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        for name in os.listdir(self._dir):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class OutputReceiver:
    """The front end's end of the engine's output socket. Messages are taken with plain non-blocking receives on a
    synchronous view of the socket and waited for with one reader on its descriptor, kept for the receiver's life:
    at one token a step, pyzmq's asyncio futures (a poll, then a receive, each registering and unregistering its
    reader) were a quarter of the API process's time, taken from the engine's two cores. The asyncio socket
    itself stays for what runs before the first wait (the ready message) and for a data-parallel poller, which
    never waits here (timeout 0)."""

    def __init__(self, socket: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder):
        self._now = zmq.Socket.shadow(socket.underlying)   # (the caller keeps the socket open)
        self._decoder = decoder
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    async def get(self, timeout_ms: int):
        """The next message decoded, or None after `timeout_ms` with none."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            # ZMQ_EVENTS says whether a message is there (cheaper than a receive raising zmq.Again), and reading
            # it clears the descriptor's signal: a message that comes after it signals the descriptor again
            if self._now.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                _, payload = self._now.recv_multipart(zmq.NOBLOCK)
                return self._decoder.decode(payload)
            left = deadline - time.monotonic()
            if left <= 0 or not await self._readable(left):
                return None

    async def _readable(self, timeout: float) -> bool:
        """Until the descriptor says a message may be there (True) or `timeout` s pass (False)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.close()
            loop.add_reader(self._now.getsockopt(zmq.FD), self._on_readable)
            self._loop = loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _resolve, waiter, False)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _on_readable(self) -> None:
        # reads ZMQ_EVENTS whether or not anyone waits: that clears the signal, or the loop would call this again
        if self._now.getsockopt(zmq.EVENTS) & zmq.POLLIN and self._waiter is not None:
            _resolve(self._waiter, True)

    def close(self) -> None:
        """Drops the reader (before the socket closes, or when another event loop takes over)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._now.getsockopt(zmq.FD))
        self._loop = None


def _resolve(future: asyncio.Future, value: bool) -> None:
    if not future.done():
        future.set_result(value)
