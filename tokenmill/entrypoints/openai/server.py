"""The OpenAI-compatible API server: FastAPI app, routes, auth, errors, health, and process lifetime."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import os
import signal
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.config import SERVER_PREFILL_TOKENS_WHILE_DECODING, EngineArgs
from tokenmill.engine.async_llm import AsyncLLM, RequestTimeoutError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.chat_output import ChatOutputOptions
from tokenmill.entrypoints.openai.cli_args import chat_output_options
from tokenmill.entrypoints.openai.engine_view import RecentActivity
from tokenmill.entrypoints.openai.errors import APIError, error_response
from tokenmill.entrypoints.openai.liveness import Liveness
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat, template_messages
from tokenmill.entrypoints.openai.serving_common import AdmissionLimits, InputLimits, ServingContext, value_error
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenmill.entrypoints.openai.serving_models import LoRAModulePath, add_lora_routes, parse_lora_modules
from tokenmill.metrics import Metrics
from tokenmill.utils import PROCESS_START, init_logger

logger = init_logger(__name__)

_OPEN_PATHS = ("/health", "/live", "/ready", "/metrics", "/version", "/load")


class APIKeyMiddleware:
    """Bearer-key check as plain ASGI. (FastAPI's @app.middleware("http") wraps `receive`, and a handler behind it
    never saw its client disconnect: a non-streamed request kept running after the client had gone.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        # the page itself is open (it holds no data); every API call it makes needs the key
        if scope["type"] == "http" and scope["path"] != "/" and not scope["path"].startswith(_OPEN_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "Unauthorized: a valid API key is required")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body up to --max-request-bytes (413 past it) before the app sees it, then hands the app
    the same body; later receives pass through, so handlers still see their client disconnect."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await error_response(413, f"the request body is larger than {self.limit} bytes "
                                          "(--max-request-bytes)")(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(engine: AsyncLLM, metrics: Metrics, served_model_name: str, api_key: str | None,
              limits: AdmissionLimits | None = None, chat_options: ChatOutputOptions | None = None,
              liveness: Liveness | None = None, input_limits: InputLimits | None = None,
              cost_per_hour: float | None = None, recent: RecentActivity | None = None,
              lora_modules: list[LoRAModulePath] = (), allow_runtime_lora_updating: bool = False) -> FastAPI:
    ctx = ServingContext(engine, served_model_name, limits, chat_options, input_limits)
    ctx.cost_per_hour = cost_per_hour
    for module in lora_modules:   # checked here, before the engine starts: a misfit stops the server at once
        lora = ctx.models.add(module.name, module.path, module.base_model_name)
        logger.info("LoRA adapter %s (id %d): %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
    liveness = liveness or Liveness()
    completions, chat = OpenAIServingCompletion(ctx), OpenAIServingChat(ctx)
    embeddings = OpenAIServingEmbedding(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.info("ready in %.1f s since the process started", time.monotonic() - PROCESS_START)
        watchdog = asyncio.create_task(liveness.watch(engine))
        yield
        watchdog.cancel()
        await engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, limit=ctx.input_limits.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestTimeoutError)
    async def timed_out(_: Request, e: RequestTimeoutError):
        return error_response(408, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{er.get('msg')}" for er in errs) or "invalid request"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, e: ValueError):
        err = value_error(e)
        return error_response(400, err.message, err.param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e))

    @app.get("/health")
    async def health():
        """Red when the engine process is gone, or when it has made no step for --engine-stall-timeout seconds
        while requests wait on it (a stuck kernel, a deadlock): the process being up is not enough."""
        if engine.dead or engine.client is None or not engine.client.is_alive:
            return error_response(503, "the engine core is not running")
        stalled = engine.stalled_for()
        if liveness.stall_timeout and stalled > liveness.stall_timeout:
            return error_response(503, f"the engine has made no progress for {stalled:.0f} s with "
                                       f"{engine.num_unfinished} requests pending")
        return Response(status_code=200)

    @app.get("/live")
    async def live():
        """The process is up and its event loop answers (for an orchestrator's liveness probe)."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        """Ready for traffic: model loaded, engine healthy, not draining, and the waiting queue not full."""
        if engine.client is None or engine.dead or ctx.draining or ctx.full or \
                (liveness.stall_timeout and engine.stalled_for() > liveness.stall_timeout):
            return error_response(503, "not ready")
        return Response(status_code=200)

    @app.get("/load")
    async def load():
        """A router's view of this replica: requests running and waiting in the engine, KV-cache usage, and
        requests the server holds (including those not yet in the engine); with --kv-transfer-config, its role,
        where it serves KV blocks, and their layout."""
        stats = engine.last_scheduler_stats
        load = {"running": stats.num_running_reqs if stats else 0, "waiting": stats.num_waiting_reqs if stats else 0,
                "kv_usage": stats.kv_cache_usage if stats else 0.0, "unfinished": engine.num_unfinished,
                "draining": ctx.draining}
        transfer = engine.config.kv_transfer_config
        if transfer is not None:   # what a disaggregating router pairs instances by
            from tokenmill.kv_transfer.config import kv_layout

            load["kv_transfer"] = {"role": transfer.kv_role, "address": transfer.address,
                                   "layout": kv_layout(engine.config)}
        return load

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.record_frontend(engine.output_processor.take_stats())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": ctx.models.cards(now())}

    add_lora_routes(app, ctx.models, allow_runtime_lora_updating)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await chat.create(req, raw)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        """The built-in page: a chat and the live engine view (static; its API calls carry the key)."""
        return HTMLResponse((Path(__file__).parent / "static" / "index.html").read_text())

    @app.get("/v1/engine/state")
    async def engine_state():
        """The live engine view's data: each engine core's requests (progress, blocks), shared and cached free
        KV blocks, and the last minute's throughput, latencies and prefix-cache hit rate."""
        try:
            states = await engine.get_state()
        except (EngineDeadError, asyncio.TimeoutError):
            return error_response(503, "the engine core did not answer")
        return {"model": served_model_name, "engines": [msgspec.to_builtins(s) for s in states],
                "recent": recent.summary() if recent is not None else None}

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embeddings.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ctx.check_model(req.model)
        ip = engine.input_processor
        if req.messages is not None:
            text = ip.apply_chat_template(template_messages(req), req.add_generation_prompt)
            tokens = engine.tokenizer(text, add_special_tokens=False).input_ids
        elif req.prompt is not None:
            tokens = engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        else:
            raise APIError(400, "give prompt or messages", "prompt")
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        ctx.check_model(req.model)
        vocab = engine.input_processor.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens has id(s) {bad[:5]} outside the vocabulary of {vocab}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return app


def server_engine_args(args: EngineArgs) -> EngineArgs:
    """The server's defaults where the flags left them open: its clients watch tokens stream, so a step that
    carries decodes takes at most SERVER_PREFILL_TOKENS_WHILE_DECODING prompt tokens."""
    if args.prefill_tokens_while_decoding is None:
        return dataclasses.replace(args, prefill_tokens_while_decoding=SERVER_PREFILL_TOKENS_WHILE_DECODING)
    return args


def keep_off_engine_host_cpus(engine: AsyncLLM) -> None:
    """Moves this process's threads (the event loop, zmq's, the tokenizer's) off the CPUs whose engine thread
    runs the engine's Python between forwards (platform.side_cpus says why). Called once the engine processes
    have started, so they keep every CPU."""
    from tokenmill.platform import engine_host_cpus, pin_process_threads, side_cpus

    clients = getattr(engine.client, "clients", None) or [engine.client]
    pinned = [engine_host_cpus(c.config.cpu_bind, c.config.parallel_config.world_size) for c in clients]
    hosts = sorted({cpu for _, h in pinned for cpu in h})
    cpus = side_cpus(sorted({cpu for e, _ in pinned for cpu in e}), hosts)
    if cpus is not None:
        pin_process_threads(cpus)
        logger.info("API server threads on CPUs %s (the engine's host thread has CPU %s)",
                    ",".join(map(str, cpus)), ",".join(map(str, hosts)))


def run_server(ns: argparse.Namespace) -> int:
    """Start the engine core and the API server; returns the process exit code."""
    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {ns.data_parallel_size}")
    import uvicorn

    from tokenmill.cli.args import engine_args_from

    args = server_engine_args(engine_args_from(ns))
    config = args.create_engine_config()   # imports no torch for a GGUF model on a CPU-only torch (~2-3 s)
    if "torch" in sys.modules:   # a model folder's config class imports it
        sys.modules["torch"].set_num_threads(1)  # the model's threads belong to the engine-core process
    name = config.model_config.served_model_name
    api_key = ns.api_key or os.environ.get("TOKENMILL_API_KEY")
    if ns.cost_per_hour is not None and not ns.cost_per_hour >= 0:
        raise ValueError(f"--cost-per-hour must be a non-negative number of USD, got {ns.cost_per_hour}")
    metrics = Metrics(name, cost_per_hour=ns.cost_per_hour)
    recent = RecentActivity(cost_per_hour=ns.cost_per_hour)
    observers = [metrics.record_output, recent.record_output]
    tracer = None
    if ns.otlp_traces_endpoint:
        from tokenmill.tracing import RequestTracer

        tracer = RequestTracer(name, ns.otlp_traces_endpoint)
        observers.append(tracer.record)
        logger.info("tracing: one span per request to %s", ns.otlp_traces_endpoint)
    limits = AdmissionLimits(ns.max_waiting_requests, ns.max_queued_tokens, ns.max_concurrent_requests_per_key,
                             ns.request_timeout, ns.cache_salt_by_api_key)
    inputs = InputLimits(ns.max_n, ns.max_logprobs, ns.max_stop_sequences, ns.max_stop_length, ns.max_logit_bias,
                         ns.max_messages, ns.max_prompts, ns.max_request_bytes)
    options, liveness = chat_output_options(ns), Liveness(ns.engine_stall_timeout, ns.engine_stall_exit_timeout)
    loras = parse_lora_modules(ns.lora_modules)
    # every flag is checked by now: the engine core starts loading while this process loads the tokenizer
    engine = AsyncLLM(config, stat_observers=[metrics.record_engine, recent.record_engine],
                      output_observers=observers, data_parallel_size=ns.data_parallel_size, launch=True)
    keep_off_engine_host_cpus(engine)
    try:
        app = build_app(engine, metrics, name, api_key, limits, options, liveness, inputs, ns.cost_per_hour, recent,
                        loras, ns.allow_runtime_lora_updating)
    except BaseException:
        engine.client.shutdown()   # launched above: stop it rather than leave it waiting for requests
        raise
    server = _Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                    timeout_graceful_shutdown=ns.drain_timeout, access_log=False), app.state.ctx)

    def engine_died() -> None:
        server.exit_code = 1
        server.should_exit = True

    engine.on_dead = engine_died
    logger.info("serving %s on http://%s:%d (API key %s)", name, ns.host, ns.port, "required" if api_key else "off")
    try:
        server.run()
    finally:
        if tracer is not None:
            tracer.shutdown()
    if server.exit_code:
        logger.error("exiting: the engine core died")
    return server.exit_code


class _Server:
    """uvicorn's server, with SIGTERM/SIGINT turning on draining (new requests get 503) before it stops."""

    def __new__(cls, config, ctx: ServingContext):
        import uvicorn

        class DrainingServer(uvicorn.Server):
            exit_code = 0

            def handle_exit(self, sig: int, frame) -> None:
                if not ctx.draining:
                    logger.info("received %s: draining in-flight requests", signal.Signals(sig).name)
                ctx.draining = True
                super().handle_exit(sig, frame)
                if sig in (signal.SIGTERM, signal.SIGINT) and hasattr(self, "_captured_signals"):
                    # a drained SIGTERM or Ctrl-C is a clean stop: exit 0 rather than re-raising the signal (which
                    # ends a SIGINT in a KeyboardInterrupt traceback)
                    self._captured_signals = [s for s in self._captured_signals if s != sig]

        return DrainingServer(config)
