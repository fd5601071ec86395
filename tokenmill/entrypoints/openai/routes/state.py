"""What the route groups share: the engine and the serving objects, built once by `server.build_app`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.engine_view import RecentActivity
    from tokenmill.entrypoints.openai.liveness import Liveness
    from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
    from tokenmill.entrypoints.openai.serving_common import ServingContext
    from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from tokenmill.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
    from tokenmill.entrypoints.openai.serving_score import OpenAIServingScore
    from tokenmill.entrypoints.openai.serving_transcription import OpenAIServingTranscription
    from tokenmill.metrics import Metrics


@dataclass
class ServerParts:
    engine: AsyncLLM
    ctx: ServingContext
    metrics: Metrics
    liveness: Liveness
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding
    scores: OpenAIServingScore
    transcriptions: OpenAIServingTranscription
    recent: RecentActivity | None = None
    allow_runtime_lora_updating: bool = False


def parts_of(raw: Request) -> ServerParts:
    return raw.app.state.parts
