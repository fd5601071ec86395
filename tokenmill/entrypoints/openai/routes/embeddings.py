"""Pooling endpoints: /v1/embeddings (served when the engine runs with --pooler)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.routes.state import parts_of
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embedding(req: EmbeddingRequest, raw: Request):
    return await parts_of(raw).embeddings.create(req, raw)
