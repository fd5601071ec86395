"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.input_processor import check_cache_salt
from tokenmill.entrypoints.openai.chat_output import ChatDeltaStream, chat_message, finish_reason, tool_parser_for
from tokenmill.entrypoints.openai.errors import APIError, param_of
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from tokenmill.entrypoints.openai.serving_beam import beam_search_params, beam_stream
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    sampling_params,
    sse,
    stream_error,
    until_disconnected,
    value_error,
)
from tokenmill.entrypoints.openai.tool_repeats import without_repeated_calls
from tokenmill.kv_transfer.config import check_kv_transfer_params
from tokenmill.multimodal.chat_parts import load_images_async
from tokenmill.multimodal.chat_parts import template_messages as chat_template_messages
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.structured_output.grammar_text import validate as validate_grammar
from tokenmill.structured_output.reasoning import after_reasoning
from tokenmill.structured_output.tools import (
    ToolChoice,
    check_tools,
    messages_without_tool_support,
    resolve_tool_choice,
    template_takes_tools,
    tool_constraint,
)


def template_messages(req, takes_images: bool = False) -> tuple[list[dict], list]:
    """Message dicts for the template, and the image URLs of their image_url parts (multimodal/chat_parts.py)."""
    return chat_template_messages([m.model_dump(exclude_none=True) for m in req.messages], takes_images)


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
        lora = ctx.check_request(req)
        given = req.max_completion_tokens is not None or req.max_tokens is not None
        options = ctx.chat_options
        try:
            functions = check_tools(req.tools)
            choice = resolve_tool_choice(req.tool_choice, functions, options.enable_auto_tool_choice
                                         and options.tool_call_parser is not None)
            text, images = self._render(req, functions, choice)
            if images:
                prompt = await self.with_images(text, images)
            else:
                prompt = engine.input_processor.process_prompt(text, add_special_tokens=False)
            prompt.cache_salt = check_cache_salt(req.cache_salt)
            prompt.kv_transfer_params = check_kv_transfer_params(req.kv_transfer_params)
            prompt.lora_request = lora
        except ValueError as e:
            raise value_error(e) from e
        params = sampling_params(req.to_sampling_params, ctx.max_model_len - len(prompt.prompt_token_ids))
        try:
            self._constrain(params, choice, functions, req.parallel_tool_calls)
        except ValueError as e:
            raise value_error(e) from e
        ctx.check_length(prompt, params, given)
        rid = req.request_id or random_id("chatcmpl")
        try:
            beams = beam_search_params(req, params.max_tokens)
        except ValueError as e:
            raise value_error(e) from e
        if beams is not None:
            stream = beam_stream(ctx, raw, prompt, beams, req.n, rid, req.priority, req.checked_timeout(),
                                 req.stop_token_ids)
            return await self._respond(req, rid, prompt, stream, tool_parser_for(choice, options), choice, raw)
        # "required" calls are watched as they come, so the list closes before a call that repeats (tool_repeats)
        unrepeated = choice.mode == "required" and req.n == 1 and options.reasoning_parser is None
        if unrepeated:
            params.output_kind = RequestOutputKind.DELTA
        try:
            stream = ctx.start(raw, [prompt], params, [rid], req.priority, req.checked_timeout())[0]
        except ValueError as e:
            raise value_error(e) from e
        if unrepeated:
            stream = without_repeated_calls(stream, whole=not req.stream)
        return await self._respond(req, rid, prompt, stream, tool_parser_for(choice, options), choice, raw)

    async def _respond(self, req: ChatCompletionRequest, rid: str, prompt, stream, parser, choice: ToolChoice,
                       raw: Request):
        if req.stream:
            return StreamingResponse(self._stream(req, rid, prompt, stream, parser, choice),
                                     media_type="text/event-stream")
        return JSONResponse(await until_disconnected(raw, self._full(rid, prompt, stream, req.top_logprobs or 0,
                                                                     parser, choice)))

    async def with_images(self, text: str, images: list):
        """The prompt with its images, fetched, decoded and preprocessed off the event loop."""
        ip = self.ctx.engine.input_processor
        try:
            loaded = await load_images_async(images, ip.media)
            return await asyncio.to_thread(ip.process_prompt, {"prompt": text, "multi_modal_data": {"image": loaded}},
                                           False)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e)) or "messages") from e

    def _render(self, req: ChatCompletionRequest, functions: dict, choice: ToolChoice) -> tuple[str, list]:
        """The prompt text and its images: tools go through the model's template when it takes them; otherwise
        (and for messages that carry tool calls or results) tokenmill writes them in the <tool_call> form."""
        ip = self.ctx.engine.input_processor
        template = req.chat_template or getattr(ip.tokenizer, "chat_template", None)
        messages, images = template_messages(req, ip.mm is not None)
        kwargs = dict(req.chat_template_kwargs or {})
        shown = functions if choice.mode != "none" else {}
        if template_takes_tools(template):
            if shown:
                kwargs["tools"] = req.tools
        elif shown or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = messages_without_tool_support(messages, shown)
        return ip.apply_chat_template(messages, req.add_generation_prompt, req.chat_template, **kwargs), images

    def _constrain(self, params, choice: ToolChoice, functions: dict, parallel: bool) -> None:
        """A required or named tool choice generates under the functions' schemas; with a reasoning parser the
        constraint starts after </think>."""
        tool = tool_constraint(choice, functions, parallel)
        if tool is not None:
            if params.structured_outputs is not None:
                raise ValueError(f"tool_choice cannot be {choice.mode!r} together with another output constraint "
                                 "(response_format or structured_outputs)")
            params.structured_outputs = validate_grammar(*tool)
        so = params.structured_outputs
        if so is not None and self.ctx.chat_options.reasoning_parser is not None:
            so.grammar_text = after_reasoning(so.grammar_text)

    async def _full(self, rid: str, prompt, stream, top_k: int, parser, choice: ToolChoice) -> dict:
        final = None
        async for ro in stream:
            final = ro
        choices = []
        for c in final.outputs:
            message, called = chat_message(c.text, parser, self.ctx.chat_options.reasoning_parser)
            choices.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c, top_k),
                            "finish_reason": finish_reason(c.finish_reason, choice, called),
                            "stop_reason": c.stop_reason})
        completion = sum(len(c.token_ids) for c in final.outputs)
        n_prompt = len(prompt.prompt_token_ids)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.ctx.model_name(prompt),
                "choices": choices, "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                              "total_tokens": n_prompt + completion,
                                              **self.ctx.cost_usage([final])}}

    async def _stream(self, req: ChatCompletionRequest, rid: str, prompt, stream, parser,
                      choice: ToolChoice) -> AsyncIterator[str]:
        created, model = now(), self.ctx.model_name(prompt)
        deltas = [ChatDeltaStream(parser, self.ctx.chat_options.reasoning_parser) for _ in range(req.n)]

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, **extra})

        # the role goes out with the first output, as vLLM sends it: a client's time to the first chunk is then
        # its time to the first token (sent at once, it made streamed TTFT read ~10 ms whatever the prompt)
        role = chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(req.n)])
        completion = 0
        last = None
        sent_role = False
        try:
            async for ro in stream:
                if not sent_role:
                    sent_role = True
                    yield role
                last = ro
                choices = []
                for c in ro.outputs:
                    completion += len(c.token_ids)
                    ds = deltas[c.index]
                    delta = ds.update(c.text, c.finish_reason is not None)
                    choices.append({"index": c.index, "delta": delta,
                                    "logprobs": chat_logprobs(c, req.top_logprobs or 0),
                                    "finish_reason": finish_reason(c.finish_reason, choice, ds.called),
                                    "stop_reason": c.stop_reason})
                yield chunk(choices)
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            if not sent_role:
                sent_role = True
                yield role
            yield stream_error(e)
        if not sent_role:
            yield role
        if req.stream_options and req.stream_options.include_usage:
            n_prompt = len(prompt.prompt_token_ids)
            yield chunk([], usage={"prompt_tokens": n_prompt, "completion_tokens": completion,
                                   "total_tokens": n_prompt + completion, **self.ctx.cost_usage([last])})
        yield SSE_DONE
