"""What completions and chat share: request checks, running prompts concurrently, SSE framing."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenmill.engine.async_llm import AsyncLLM, RequestStream, RequestTimeoutError
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.chat_output import ChatOutputOptions
from tokenmill.entrypoints.openai.errors import APIError, param_of
from tokenmill.entrypoints.openai.serving_models import ServingModels
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class AdmissionLimits:
    """The server's bounds on what it holds (flags of the same names)."""
    max_waiting_requests: int | None = None      # beyond max_num_seqs running: 503
    max_queued_tokens: int | None = None         # prompt tokens of the requests held (running or waiting): 503
    max_concurrent_requests_per_key: int | None = None   # per API key: 429
    request_timeout: float | None = None         # default `timeout` of a request, seconds
    cache_salt_by_api_key: bool = False          # each bearer key gets its own prefix-cache namespace


@dataclass
class InputLimits:
    """Bounds on each field a request can make large (flags of the same names); past one, a 400 naming it."""
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_logit_bias: int = 300
    max_messages: int = 1024
    max_prompts: int = 256
    max_request_bytes: int = 8 * 2**20

    def check(self, req) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}")

        need(req.n <= self.max_n, "n", f"at most {self.max_n} (--max-n)")
        best_of = getattr(req, "best_of", None)
        need(best_of is None or best_of <= self.max_n, "best_of", f"at most {self.max_n} (--max-n)")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                need(value <= self.max_logprobs, name, f"at most {self.max_logprobs} (--max-logprobs)")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        need(len(stops) <= self.max_stop_sequences, "stop",
             f"at most {self.max_stop_sequences} strings (--max-stop-sequences)")
        need(all(len(x) <= self.max_stop_length for x in stops), "stop",
             f"strings of at most {self.max_stop_length} characters (--max-stop-length)")
        need(len(req.stop_token_ids or []) <= self.max_logit_bias, "stop_token_ids",
             f"at most {self.max_logit_bias} ids (--max-logit-bias)")
        need(len(req.logit_bias or {}) <= self.max_logit_bias, "logit_bias",
             f"at most {self.max_logit_bias} entries (--max-logit-bias)")
        messages = getattr(req, "messages", None)
        need(messages is None or len(messages) <= self.max_messages, "messages",
             f"at most {self.max_messages} messages (--max-messages)")
        prompt = getattr(req, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            need(len(prompt) <= self.max_prompts, "prompt", f"at most {self.max_prompts} prompts (--max-prompts)")


class ServingContext:
    """Server-wide settings the handlers need, and admission: requests are counted the moment they are admitted
    (before the handler yields), so a burst arriving together meets the bounds one by one."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, limits: AdmissionLimits | None = None,
                 chat_options: ChatOutputOptions | None = None, input_limits: InputLimits | None = None):
        self.engine = engine
        self.chat_options = chat_options or ChatOutputOptions()
        self.served_model_name = served_model_name
        self.models = ServingModels(served_model_name, engine.config)
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.limits = limits or AdmissionLimits()
        self.input_limits = input_limits or InputLimits()
        self.draining = False
        self.queued_tokens = 0
        self.per_key: collections.Counter[str] = collections.Counter()
        self.cost_per_hour: float | None = None   # --cost-per-hour: usage then carries engine time and cost

    def cost_usage(self, outputs) -> dict:
        """The usage fields --cost-per-hour adds: the requests' share of engine time, and what it cost."""
        if self.cost_per_hour is None:
            return {}
        seconds = sum(ro.metrics.engine_seconds for ro in outputs if ro is not None and ro.metrics is not None)
        return {"engine_seconds": round(seconds, 6), "cost_usd": seconds * self.cost_per_hour / 3600}

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter that `model` names (None: the base model); 404 for a model the server does not have."""
        return self.models.resolve(model)

    def check_request(self, req) -> LoRARequest | None:
        """The model (its adapter, if it names one), then every size limit (400 naming the field)."""
        lora = self.check_model(req.model)
        if self.engine.config.model_config.num_labels:
            raise APIError(400, "this model is a cross-encoder (*ForSequenceClassification): it scores pairs "
                                "(/v1/score, /v1/rerank) and does not generate", "model")
        if getattr(self.engine.config.model_config.hf_config, "is_encoder_decoder", False):
            raise APIError(400, f"model {self.served_model_name!r} is a speech model: it transcribes audio "
                                "(/v1/audio/transcriptions, /v1/audio/translations) and takes no text prompts",
                           "model")
        try:
            self.input_limits.check(req)
        except ValueError as e:
            raise value_error(e) from e
        return lora

    def model_name(self, prompt) -> str:
        """The `model` a response reports: the adapter's name, or the base model's."""
        lora = getattr(prompt, "lora_request", None)
        return lora.lora_name if lora is not None else self.served_model_name

    @property
    def full(self) -> bool:
        bound = self.limits.max_waiting_requests
        return bound is not None and self.engine.num_unfinished >= self.engine.config.scheduler_config.max_num_seqs \
            + bound

    def retry_after(self) -> str:
        """Seconds until a place is likely free: the requests ahead, over the rate requests finished lately."""
        now = time.monotonic()
        recent = [t for t in self.engine.finish_times if now - t < 30.0]
        rate = len(recent) / min(30.0, max(now - recent[0], 1.0)) if recent else 0.0
        ahead = max(1, self.engine.num_unfinished - self.engine.config.scheduler_config.max_num_seqs + 1)
        return str(max(1, min(60, math.ceil(ahead / rate)))) if rate > 0 else "5"

    def _refuse(self, status: int, message: str) -> APIError:
        return APIError(status, message, headers={"Retry-After": self.retry_after()})

    def start(self, raw: Request | None, prompts: list[ProcessedPrompt], params: SamplingParams, request_ids: list[str],
              priority: int = 0, timeout: float | None = None) -> list[RequestStream]:
        """Admit the prompts (503/429 with Retry-After past a bound) and register them with the engine."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine.dead:
            raise APIError(503, "the engine is not running")
        lim, sched = self.limits, self.engine.config.scheduler_config
        n = len(prompts) * params.n
        if lim.max_waiting_requests is not None and \
                self.engine.num_unfinished + len(prompts) > sched.max_num_seqs + lim.max_waiting_requests:
            raise self._refuse(503, f"the server is overloaded: more than {lim.max_waiting_requests} requests are "
                                    "waiting")
        tokens = sum(len(p.prompt_token_ids) for p in prompts) * params.n
        if lim.max_queued_tokens is not None and self.queued_tokens and \
                self.queued_tokens + tokens > lim.max_queued_tokens:
            raise self._refuse(503, f"the server is overloaded: more than {lim.max_queued_tokens} prompt tokens are "
                                    "queued")
        key = api_key_of(raw) if lim.max_concurrent_requests_per_key is not None and raw is not None else None
        if key is not None and self.per_key[key] + n > lim.max_concurrent_requests_per_key:
            raise self._refuse(429, f"too many concurrent requests for this API key (at most "
                                    f"{lim.max_concurrent_requests_per_key})")
        timeout = timeout if timeout is not None else lim.request_timeout
        caller = api_key_of(raw) if lim.cache_salt_by_api_key and raw is not None else None
        if caller is not None:   # tenants never share cached blocks, whatever salt they send themselves
            tenant = hashlib.sha256(caller.encode()).hexdigest()[:32]
            for p in prompts:
                p.cache_salt = f"{tenant}:{p.cache_salt}" if p.cache_salt else tenant
        streams = []
        try:
            for p, rid in zip(prompts, request_ids):
                streams.append(self.engine.generate(p, params, rid, priority, timeout))
        except BaseException:
            for st in streams:
                st.close()
            raise
        for p, st in zip(prompts, streams):
            self._hold(st, len(p.prompt_token_ids) * params.n, key, params.n)
        return streams

    def _hold(self, stream: RequestStream, tokens: int, key: str | None, n: int) -> None:
        self.queued_tokens += tokens
        if key is not None:
            self.per_key[key] += n

        def release() -> None:
            self.queued_tokens -= tokens
            if key is not None:
                self.per_key[key] -= n
                if self.per_key[key] <= 0:
                    del self.per_key[key]

        stream.on_close.append(release)

    def check_length(self, prompt: ProcessedPrompt, params: SamplingParams, max_tokens_given: bool) -> None:
        n = len(prompt.prompt_token_ids)
        if max_tokens_given and params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                                f"in the completion). Please reduce the length of the prompt or completion.",
                           "max_tokens")


def api_key_of(raw: Request) -> str | None:
    """The caller's bearer key; None for a caller without one (per-key limits do not apply to it)."""
    auth = raw.headers.get("authorization", "")
    return auth.removeprefix("Bearer ").strip() or None


def stream_error(e: Exception) -> str:
    """The last event of a stream that fails after it started: an OpenAI error body, never a stream that just
    stops."""
    if isinstance(e, RequestTimeoutError):
        status, kind = 408, "timeout_error"
    elif isinstance(e, ValueError):
        status, kind = 400, "invalid_request_error"
    else:
        status, kind = 500, "internal_server_error"
    return sse({"error": {"message": str(e), "type": kind, "param": None, "code": status}})


def value_error(e: ValueError) -> APIError:
    message = str(e)
    return APIError(400, message, param_of(message))


def sampling_params(build, default_max_tokens: int) -> SamplingParams:
    try:
        return build(default_max_tokens)
    except ValueError as e:
        raise value_error(e) from e


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generators as results arrive; closing this closes (and aborts) them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(raw: Request, coro) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
