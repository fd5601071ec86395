"""Speech: /v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart form), served by a Whisper
model; any other model answers 400."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.routes.state import parts_of

router = APIRouter()


@router.post("/v1/audio/transcriptions")
async def create_transcription(raw: Request):
    return await parts_of(raw).transcriptions.create(raw, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(raw: Request):
    return await parts_of(raw).transcriptions.create(raw, "translate")
