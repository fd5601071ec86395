"""The OpenAI-compatible API server: builds the app from the route groups (`routes/`), the key and body checks
(`middleware.py`) and the error bodies (`errors.py`), and runs it for the process's lifetime (draining on SIGTERM)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tokenmill import __version__
from tokenmill.config import SERVER_PREFILL_TOKENS_WHILE_DECODING, EngineArgs
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.chat_output import ChatOutputOptions
from tokenmill.entrypoints.openai.cli_args import chat_output_options
from tokenmill.entrypoints.openai.engine_view import RecentActivity
from tokenmill.entrypoints.openai.errors import add_exception_handlers
from tokenmill.entrypoints.openai.liveness import Liveness
from tokenmill.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware
from tokenmill.entrypoints.openai.routes import admin, audio, embeddings, generate, health, page
from tokenmill.entrypoints.openai.routes.state import ServerParts
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_common import AdmissionLimits, InputLimits, ServingContext
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenmill.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_modules
from tokenmill.entrypoints.openai.serving_score import OpenAIServingScore
from tokenmill.entrypoints.openai.serving_transcription import OpenAIServingTranscription
from tokenmill.metrics import Metrics
from tokenmill.utils import PROCESS_START, init_logger

logger = init_logger(__name__)

def build_app(engine: AsyncLLM, metrics: Metrics, served_model_name: str, api_key: str | None,
              limits: AdmissionLimits | None = None, chat_options: ChatOutputOptions | None = None,
              liveness: Liveness | None = None, input_limits: InputLimits | None = None,
              cost_per_hour: float | None = None, recent: RecentActivity | None = None,
              lora_modules: list[LoRAModulePath] = (), allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The app: the route groups over one set of serving parts, the key and body-size checks in front of them."""
    ctx = ServingContext(engine, served_model_name, limits, chat_options, input_limits)
    ctx.cost_per_hour = cost_per_hour
    for module in lora_modules:   # checked here, before the engine starts: a misfit stops the server at once
        lora = ctx.models.add(module.name, module.path, module.base_model_name)
        logger.info("LoRA adapter %s (id %d): %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
    parts = ServerParts(engine, ctx, metrics, liveness or Liveness(), OpenAIServingCompletion(ctx),
                        OpenAIServingChat(ctx), OpenAIServingEmbedding(ctx), OpenAIServingScore(ctx),
                        OpenAIServingTranscription(ctx), recent,
                        allow_runtime_lora_updating)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.info("ready in %.1f s since the process started", time.monotonic() - PROCESS_START)
        watchdog = asyncio.create_task(parts.liveness.watch(engine))
        yield
        watchdog.cancel()
        await engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.parts = parts
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # an audio upload may be as large as --max-media-bytes, whatever the JSON routes' --max-request-bytes
    app.add_middleware(BodyLimitMiddleware, limit=ctx.input_limits.max_request_bytes,
                       upload_limit=max(ctx.input_limits.max_request_bytes,
                                        engine.config.media.max_media_bytes + (1 << 20)))
    add_exception_handlers(app)
    for group in (health, admin, generate, embeddings, audio, page):
        app.include_router(group.router)
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
    from tokenmill.engine.create_config import create_engine_config

    args = server_engine_args(engine_args_from(ns))
    config = create_engine_config(args)   # imports no torch for a GGUF model on a CPU-only torch (~2-3 s)
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
                                    timeout_graceful_shutdown=ns.drain_timeout, access_log=False), app.state.parts.ctx)

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
