"""POST /v1/embeddings (OpenAI's shape): one embedding per input, pooled from the prompt's final hidden states by
the engine (--pooler), through the same scheduler as the server's generation traffic."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.input_processor import check_cache_salt
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import random_id
from tokenmill.entrypoints.openai.serving_common import ServingContext, merge, until_disconnected, value_error
from tokenmill.sampling_params import SamplingParams


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra fields
    priority: int = 0
    cache_salt: str | None = None


def _inputs(value: Any) -> list:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) for t in value):
        return [{"prompt_token_ids": value}]
    return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    """base64 is OpenAI's: the float32 values' little-endian bytes."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
    return vec


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, req: EmbeddingRequest, raw: Request):
        ctx, engine = self.ctx, self.ctx.engine
        lora = ctx.check_model(req.model)
        pooler = engine.config.pooler
        if pooler is None:
            raise APIError(400, "this server does not serve embeddings: start it with --pooler last|mean|cls", "model")
        width = int(engine.config.model_config.hf_config.hidden_size)
        if req.dimensions is not None and req.dimensions != width:
            raise APIError(400, f"dimensions: this model's embeddings have {width} dimensions and it cannot give "
                                f"{req.dimensions} (it is not a Matryoshka model)", "dimensions")
        inputs = _inputs(req.input)
        if not inputs:
            raise APIError(400, "input must not be empty", "input")
        limit = ctx.input_limits.max_prompts
        if len(inputs) > limit:
            raise APIError(400, f"input must be at most {limit} inputs (--max-prompts)", "input")
        try:
            prompts = [engine.input_processor.process_prompt(p) for p in inputs]
            for p in prompts:
                p.cache_salt = check_cache_salt(req.cache_salt)
                p.lora_request = lora
        except ValueError as e:
            raise value_error(e) from e
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling=pooler)
        rid = random_id("embd")
        try:
            streams = ctx.start(raw, prompts, params, [f"{rid}-{i}" for i in range(len(prompts))], req.priority)
        except ValueError as e:
            raise value_error(e) from e

        async def collect() -> dict:
            embeddings: dict[int, list[float]] = {}
            async for i, ro in merge(streams):
                if ro.finished:
                    embeddings[i] = ro.embedding
            tokens = sum(len(p.prompt_token_ids) for p in prompts)
            data = [{"object": "embedding", "index": i, "embedding": _encode(embeddings[i], req.encoding_format)}
                    for i in range(len(prompts))]
            return {"object": "list", "model": ctx.model_name(prompts[0]), "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        return await until_disconnected(raw, collect())
