"""POST /v1/score (vLLM's shape) and /v1/rerank (Jina's and Cohere's): a cross-encoder scores each pair as one
prompt; an embedding model (--pooler) scores by the cosine of the two embeddings. Both run as pooling requests
through the same scheduler as the server's other traffic."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import now, random_id
from tokenmill.entrypoints.openai.serving_common import ServingContext, merge, until_disconnected, value_error
from tokenmill.entrypoints.scoring import cosine, cross_encoder_score, pair_token_ids, score_pairs
from tokenmill.sampling_params import SamplingParams


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = None
    return_documents: bool = True
    priority: int = 0


def _document_texts(documents: list) -> list[str]:
    if not documents:
        raise APIError(400, "documents must not be empty", "documents")
    texts = []
    for i, d in enumerate(documents):
        text = d if isinstance(d, str) else d.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"documents[{i}] must be a string or an object with a 'text' string", "documents")
        texts.append(text)
    return texts


class OpenAIServingScore:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def score(self, req: ScoreRequest, raw: Request) -> dict:
        lora = self.ctx.check_model(req.model)
        try:
            pairs = score_pairs(req.text_1, req.text_2)
        except ValueError as e:
            raise value_error(e) from e
        self._check_pairs(len(pairs))
        scores, tokens = await until_disconnected(raw, self._scores(pairs, raw, req.priority, lora))
        return {"id": random_id("score"), "object": "list", "created": now(), "model": self._name(lora),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, req: RerankRequest, raw: Request) -> dict:
        lora = self.ctx.check_model(req.model)
        texts = _document_texts(req.documents)
        if req.top_n is not None and req.top_n < 1:
            raise APIError(400, f"top_n must be a positive integer, got {req.top_n}", "top_n")
        self._check_pairs(len(texts))
        scores, tokens = await until_disconnected(raw, self._scores([(req.query, t) for t in texts], raw,
                                                                    req.priority, lora))
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:req.top_n or len(texts)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in order]
        return {"id": random_id("rerank"), "model": self._name(lora), "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _name(self, lora) -> str:
        return lora.lora_name if lora is not None else self.ctx.served_model_name

    def _check_pairs(self, n: int) -> None:
        limit = self.ctx.input_limits.max_prompts
        if n > limit:
            raise APIError(400, f"at most {limit} pairs a request (--max-prompts), got {n}", "documents")

    async def _scores(self, pairs: list[tuple[str, str]], raw: Request, priority: int, lora) -> tuple[list, int]:
        """Each pair's score and the prompt tokens it took."""
        engine = self.ctx.engine
        if engine.config.model_config.num_labels:
            prompts = [ProcessedPrompt(None, pair_token_ids(engine.tokenizer, a, b), lora_request=lora)
                       for a, b in pairs]
            outs = await self._pooled(prompts, False, raw, priority)
            try:
                return [cross_encoder_score(v) for v in outs], sum(len(p.prompt_token_ids) for p in prompts)
            except ValueError as e:
                raise APIError(400, str(e), "model") from e
        if engine.config.pooler is None:
            raise APIError(400, "this model cannot score: it is neither a cross-encoder (*ForSequenceClassification) "
                                "nor served with --pooler (which scores by cosine of embeddings)", "model")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        try:
            prompts = [engine.input_processor.process_prompt(t) for t in texts]
        except ValueError as e:
            raise value_error(e) from e
        for p in prompts:
            p.lora_request = lora
        vecs = dict(zip(texts, await self._pooled(prompts, True, raw, priority)))
        return [cosine(vecs[a], vecs[b]) for a, b in pairs], sum(len(p.prompt_token_ids) for p in prompts)

    async def _pooled(self, prompts: list[ProcessedPrompt], normalize: bool, raw: Request, priority: int) -> list:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling=self.ctx.engine.config.pooler,
                                normalize=normalize)
        rid = random_id("pool")
        try:
            streams = self.ctx.start(raw, prompts, params, [f"{rid}-{i}" for i in range(len(prompts))], priority)
        except ValueError as e:
            raise value_error(e) from e
        vecs: dict[int, list[float]] = {}
        async for i, ro in merge(streams):
            if ro.finished:
                vecs[i] = ro.embedding
        return [vecs[i] for i in range(len(prompts))]
