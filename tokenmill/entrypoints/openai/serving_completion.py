"""POST /v1/completions, streaming and not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.input_processor import check_cache_salt
from tokenmill.entrypoints.openai.protocol import CompletionRequest, now, random_id
from tokenmill.entrypoints.openai.serving_beam import beam_search_params, beam_stream
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    merge,
    sampling_params,
    sse,
    stream_error,
    until_disconnected,
    value_error,
)
from tokenmill.kv_transfer.config import check_kv_transfer_params
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput


def _prompts(prompt) -> list:
    if isinstance(prompt, list) and not prompt:
        raise ValueError("prompt must not be empty")
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def legacy_logprobs(entries: list[dict[int, Logprob]] | list, token_ids: list[int], tokenizer,
                    text_offset: int = 0) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for tok, entry in zip(token_ids, entries):
        text = tokenizer.decode([tok])
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tok].logprob)
        tops.append({e.decoded_token: e.logprob for e in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw: Request):
        ctx, engine = self.ctx, self.ctx.engine
        lora = ctx.check_request(req)
        if req.suffix:
            raise value_error(ValueError("suffix is not supported"))
        if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
            raise value_error(ValueError("best_of must equal n unless use_beam_search is set"))
        params = sampling_params(req.to_sampling_params, 16)
        try:
            beams = beam_search_params(req, params.max_tokens, req.best_of)
        except ValueError as e:
            raise value_error(e) from e
        try:
            prompts = [engine.input_processor.process_prompt(p) for p in _prompts(req.prompt)]
            for p in prompts:
                p.cache_salt = check_cache_salt(req.cache_salt)
                p.kv_transfer_params = check_kv_transfer_params(req.kv_transfer_params)
                p.lora_request = lora
        except ValueError as e:
            raise value_error(e) from e
        for p in prompts:
            ctx.check_length(p, params, req.max_tokens is not None)
        rid = req.request_id or random_id("cmpl")
        ids = [f"{rid}-{i}" for i in range(len(prompts))]
        try:
            if beams is not None:
                streams = [beam_stream(ctx, raw, p, beams, req.n, i, req.priority, req.checked_timeout(),
                                       req.stop_token_ids) for p, i in zip(prompts, ids)]
            else:
                streams = ctx.start(raw, prompts, params, ids, req.priority, req.checked_timeout())
        except ValueError as e:
            raise value_error(e) from e
        if req.stream:
            return StreamingResponse(self._stream(req, rid, prompts, streams), media_type="text/event-stream")
        return JSONResponse(await until_disconnected(raw, self._full(req, rid, prompts, streams)))

    def _prompt_text(self, prompt) -> str:
        return prompt.prompt if prompt.prompt is not None else self.ctx.engine.tokenizer.decode(prompt.prompt_token_ids)

    async def _full(self, req: CompletionRequest, rid: str, prompts, streams) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for i, ro in merge(streams):
            finals[i] = ro
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            ro = finals[i]
            for c in ro.outputs:
                choices.append(self._choice(req, i, c, ro, echo=req.echo))
                completion_tokens += len(c.token_ids)
        prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.ctx.model_name(prompts[0]),
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens,
                                              **self.ctx.cost_usage(finals.values())}}

    def _choice(self, req: CompletionRequest, prompt_idx: int, c: CompletionOutput, ro: RequestOutput,
                echo: bool) -> dict:
        tok = self.ctx.engine.tokenizer
        text, logprobs = c.text, None
        prefix = ""
        if echo:
            prefix = self._prompt_text(_prompt_of(ro))
            text = prefix + text
        if req.logprobs is not None:
            entries, ids = list(c.logprobs or []), list(c.token_ids)
            if echo and ro.prompt_logprobs is not None:
                entries, ids = list(ro.prompt_logprobs) + entries, list(ro.prompt_token_ids) + ids
                prefix = ""
            logprobs = legacy_logprobs(entries, ids, tok, len(prefix))
        return {"index": prompt_idx * req.n + c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def _stream(self, req: CompletionRequest, rid: str, prompts, streams) -> AsyncIterator[str]:
        created, model = now(), self.ctx.model_name(prompts[0])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = 0
        echoed: set[int] = set()
        last: dict[int, RequestOutput] = {}
        try:
            async for i, ro in merge(streams):
                last[i] = ro
                choices = []
                for c in ro.outputs:
                    index = i * req.n + c.index
                    choice = self._choice(req, i, c, ro, echo=req.echo and index not in echoed)
                    echoed.add(index)
                    completion_tokens += len(c.token_ids)
                    choices.append(choice)
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": choices})
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield stream_error(e)
        if include_usage:
            prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens,
                                 **self.ctx.cost_usage(last.values())}})
        yield SSE_DONE


def _prompt_of(ro: RequestOutput):
    from tokenmill.engine.input_processor import ProcessedPrompt

    return ProcessedPrompt(ro.prompt, ro.prompt_token_ids)
