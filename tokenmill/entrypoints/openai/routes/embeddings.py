"""Pooling endpoints: /v1/embeddings (served when the engine runs with --pooler), /v1/score and /v1/rerank
(a cross-encoder, or cosine of embeddings); /score, /rerank and /v2/rerank are the same as vLLM serves them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.routes.state import parts_of
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingRequest
from tokenmill.entrypoints.openai.serving_score import RerankRequest, ScoreRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embedding(req: EmbeddingRequest, raw: Request):
    return await parts_of(raw).embeddings.create(req, raw)


@router.post("/v1/score")
@router.post("/score")
async def create_score(req: ScoreRequest, raw: Request):
    return await parts_of(raw).scores.score(req, raw)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def create_rerank(req: RerankRequest, raw: Request):
    return await parts_of(raw).scores.rerank(req, raw)
