"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.input_processor import check_cache_salt
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    sampling_params,
    sse,
    until_disconnected,
    value_error,
)
from tokenmill.outputs import CompletionOutput


def template_messages(req) -> list[dict]:
    """Message dicts for the template; content given as a list of parts is joined to its text parts."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(d.get("content"), list):
            d["content"] = "".join(p.get("text", "") for p in d["content"] if p.get("type") == "text")
        out.append(d)
    return out


def chat_logprobs(c: CompletionOutput, top_k: int) -> dict | None:
    if c.logprobs is None:
        return None

    def item(e) -> dict:
        return {"token": e.decoded_token, "logprob": e.logprob, "bytes": list(e.decoded_token.encode())}

    return {"content": [{**item(entry[tok]), "top_logprobs": [item(e) for e in sorted(
        entry.values(), key=lambda e: e.rank)[:top_k]]} for tok, entry in zip(c.token_ids, c.logprobs)]}


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, raw: Request):
        ctx, engine = self.ctx, self.ctx.engine
        ctx.check_model(req.model)
        given = req.max_completion_tokens is not None or req.max_tokens is not None
        try:
            text = engine.input_processor.apply_chat_template(template_messages(req), req.add_generation_prompt,
                                                              req.chat_template, **(req.chat_template_kwargs or {}))
            prompt = engine.input_processor.process_prompt(text, add_special_tokens=False)
            prompt.cache_salt = check_cache_salt(req.cache_salt)
        except ValueError as e:
            raise value_error(e) from e
        params = sampling_params(req.to_sampling_params, ctx.max_model_len - len(prompt.prompt_token_ids))
        ctx.check_length(prompt, params, given)
        ctx.check_capacity()
        rid = req.request_id or random_id("chatcmpl")
        stream = engine.generate(prompt, params, rid, req.priority)
        if req.stream:
            return StreamingResponse(self._stream(req, rid, prompt, stream), media_type="text/event-stream")
        return JSONResponse(await until_disconnected(raw, self._full(rid, prompt, stream, req.top_logprobs or 0)))

    async def _full(self, rid: str, prompt, stream, top_k: int) -> dict:
        final = None
        async for ro in stream:
            final = ro
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, top_k), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in final.outputs]
        completion = sum(len(c.token_ids) for c in final.outputs)
        n_prompt = len(prompt.prompt_token_ids)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.ctx.served_model_name,
                "choices": choices, "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                              "total_tokens": n_prompt + completion}}

    async def _stream(self, req: ChatCompletionRequest, rid: str, prompt, stream) -> AsyncIterator[str]:
        created, model = now(), self.ctx.served_model_name

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, **extra})

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        completion = 0
        try:
            async for ro in stream:
                choices = []
                for c in ro.outputs:
                    completion += len(c.token_ids)
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    choices.append({"index": c.index, "delta": delta,
                                    "logprobs": chat_logprobs(c, req.top_logprobs or 0),
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                yield chunk(choices)
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse({"error": {"message": str(e), "type": "internal_server_error", "param": None, "code": 500}})
        if req.stream_options and req.stream_options.include_usage:
            n_prompt = len(prompt.prompt_token_ids)
            yield chunk([], usage={"prompt_tokens": n_prompt, "completion_tokens": completion,
                                   "total_tokens": n_prompt + completion})
        yield SSE_DONE
