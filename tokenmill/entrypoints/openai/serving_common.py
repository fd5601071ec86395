"""What completions and chat share: request checks, running prompts concurrently, SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.chat_output import ChatOutputOptions
from tokenmill.entrypoints.openai.errors import APIError, param_of
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class ServingContext:
    """Server-wide settings the handlers need."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, max_waiting_requests: int | None,
                 chat_options: ChatOutputOptions | None = None):
        self.engine = engine
        self.chat_options = chat_options or ChatOutputOptions()
        self.served_model_name = served_model_name
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.draining = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_capacity(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine.dead:
            raise APIError(503, "the engine is not running")
        bound = self.max_waiting_requests
        if bound is not None and self.engine.num_unfinished >= self.engine.config.scheduler_config.max_num_seqs + bound:
            raise APIError(503, f"the server is overloaded: more than {bound} requests are waiting")

    def check_length(self, prompt: ProcessedPrompt, params: SamplingParams, max_tokens_given: bool) -> None:
        n = len(prompt.prompt_token_ids)
        if max_tokens_given and params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                                f"in the completion). Please reduce the length of the prompt or completion.",
                           "max_tokens")


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
