"""POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart form): the upload is decoded
and cut into windows of at most 30 s, each window is one engine request (so a long clip's windows, and other
uploads, decode together), and the windows' segments are joined in order. stream=true sends the text as SSE
deltas in vLLM's transcription.chunk shape, window after window."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile

from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import now, random_id
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    merge,
    sse,
    stream_error,
    until_disconnected,
)
from tokenmill.multimodal.audio import SAMPLE_RATE, check_duration, decode_audio
from tokenmill.multimodal.speech import AudioProcessor
from tokenmill.multimodal.transcription import TranscriptionOptions, join, render, window_segments
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
           "timestamp_granularities", "stream", "stream_include_usage", "stream_continuous_usage_stats"}


class OpenAIServingTranscription:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    @property
    def audio(self) -> AudioProcessor | None:
        mm = self.ctx.engine.input_processor.mm
        return mm if isinstance(mm, AudioProcessor) else None

    async def create(self, raw: Request, task: str):
        audio = self.audio
        if audio is None:
            raise APIError(400, f"model {self.ctx.served_model_name!r} is not a speech model: it takes no audio "
                                "(serve a Whisper model for /v1/audio/*)", "model")
        form = await self._form(raw)
        self.ctx.check_model(form.get("model") or None)
        opts, stream = self._options(form, task)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file is required: the audio to transcribe, as a multipart file field", "file")
        data = await upload.read()
        limit = self.ctx.engine.config.media.max_media_bytes
        if len(data) > limit:
            raise APIError(400, f"file is {len(data)} bytes, over the limit of {limit} (--max-media-bytes)", "file")
        try:
            samples = await asyncio.to_thread(decode_audio, data, "file")
            check_duration(samples, audio.max_seconds, "file")
            if audio.needs_detection(opts):
                opts = await self._detect_language(raw, audio, samples, opts)
            windows = await asyncio.to_thread(audio.windows, samples, opts, self.ctx.engine.tokenizer)
            prompts = [ProcessedPrompt(None, ids, mm_features=[f]) for _, ids, f in windows]
        except ValueError as e:
            raise APIError(400, str(e), "file" if str(e).startswith("file") else None) from e
        room = self.ctx.max_model_len - max(len(p.prompt_token_ids) for p in prompts)
        params = SamplingParams(temperature=opts.temperature, max_tokens=max(1, room),
                                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        rid = random_id("trsc")
        streams = self.ctx.start(raw, prompts, params, [f"{rid}-{i}" for i in range(len(prompts))])
        duration = len(samples) / SAMPLE_RATE
        if stream:
            return StreamingResponse(self._stream(rid, streams), media_type="text/event-stream")
        finals = await until_disconnected(raw, self._collect(streams))
        decode = self.ctx.engine.tokenizer.decode
        segments = [window_segments(finals[i].outputs[0].token_ids, w, audio.tokens, decode)
                    for i, (w, _, _) in enumerate(windows)]
        body = render(join(segments, duration, opts, audio.tokens), opts.response_format)
        if isinstance(body, dict):
            return JSONResponse(body)
        return PlainTextResponse(body, media_type="text/vtt" if opts.response_format == "vtt" else "text/plain")

    async def _detect_language(self, raw: Request, audio: AudioProcessor, samples,
                               opts: TranscriptionOptions) -> TranscriptionOptions:
        """A one-token request first: the language the model hears in the first 30 s."""
        ids, feature = await asyncio.to_thread(audio.detection_request, samples)
        streams = self.ctx.start(raw, [ProcessedPrompt(None, ids, mm_features=[feature])],
                                 SamplingParams(temperature=0, max_tokens=1), [random_id("lang")])
        finals = await until_disconnected(raw, self._collect(streams))
        return dataclasses.replace(opts, language=audio.language_of(finals[0].outputs[0].token_ids[0]))

    @staticmethod
    async def _form(raw: Request):
        if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "the body must be multipart/form-data with a file field (OpenAI's audio API)")
        try:
            form = await raw.form()
        except Exception as e:  # noqa: BLE001 - a malformed multipart body is the client's
            raise APIError(400, f"the multipart body could not be read: {e}") from e
        unknown = sorted(set(form.keys()) - _FIELDS)
        if unknown:
            raise APIError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
        return form

    @staticmethod
    def _options(form, task: str) -> tuple[TranscriptionOptions, bool]:
        def text(name: str) -> str | None:
            v = form.get(name)
            if v is not None and not isinstance(v, str):
                raise APIError(400, f"{name} must be a text field", name)
            return v or None

        try:
            temperature = float(text("temperature") or 0.0)
        except ValueError:
            raise APIError(400, "temperature must be a number", "temperature") from None
        grans = [g for key in ("timestamp_granularities[]", "timestamp_granularities") for g in form.getlist(key)]
        if any(g not in ("segment",) for g in grans):
            raise APIError(400, "timestamp_granularities may only be segment (word timestamps are not served)",
                           "timestamp_granularities")
        opts = TranscriptionOptions(task=task, language=text("language"), prompt=text("prompt"),
                                    temperature=temperature, response_format=text("response_format") or "json")
        stream = (text("stream") or "false").lower() in ("true", "1", "yes")
        try:
            opts.check()
        except ValueError as e:
            raise APIError(400, str(e), str(e).split()[0]) from e
        if stream and opts.response_format not in ("json", "text"):
            raise APIError(400, "stream=true sends text deltas: response_format must be json or text", "stream")
        return opts, stream

    @staticmethod
    async def _collect(streams) -> dict:
        finals = {}
        async for i, ro in merge(streams):
            finals[i] = ro
        return finals

    async def _stream(self, rid: str, streams) -> AsyncIterator[str]:
        """Each window's deltas in order (the later windows decode meanwhile; their outputs wait)."""
        created, model = now(), self.ctx.served_model_name
        try:
            for i, st in enumerate(streams):
                first = True
                async for ro in st:
                    text = ro.outputs[0].text
                    if first and i:
                        text = " " + text.lstrip()
                    first = first and not text
                    if text:
                        yield sse({"id": rid, "object": "transcription.chunk", "created": created, "model": model,
                                   "choices": [{"delta": {"content": text}, "finish_reason": None}]})
            yield sse({"id": rid, "object": "transcription.chunk", "created": created, "model": model,
                       "choices": [{"delta": {}, "finish_reason": "stop"}]})
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event, never silently
            yield stream_error(e)
        finally:
            for st in streams:
                st.close()
        yield SSE_DONE
