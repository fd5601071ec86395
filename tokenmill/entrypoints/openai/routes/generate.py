"""Text generation: /v1/completions, /v1/chat/completions, and /tokenize and /detokenize beside them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.routes.state import parts_of
from tokenmill.entrypoints.openai.serving_chat import template_messages

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, raw: Request):
    return await parts_of(raw).completions.create(req, raw)


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
    return await parts_of(raw).chat.create(req, raw)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request):
    parts = parts_of(raw)
    parts.ctx.check_model(req.model)
    engine = parts.engine
    if req.messages is not None:
        messages, images = template_messages(req, engine.input_processor.mm is not None)
        text = engine.input_processor.apply_chat_template(messages, req.add_generation_prompt)
        if images:   # each placeholder expanded, as the chat would run it
            tokens = (await parts.chat.with_images(text, images)).prompt_token_ids
        else:
            tokens = engine.tokenizer(text, add_special_tokens=False).input_ids
    elif req.prompt is not None:
        tokens = engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    else:
        raise APIError(400, "give prompt or messages", "prompt")
    return {"count": len(tokens), "max_model_len": parts.ctx.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request):
    parts = parts_of(raw)
    parts.ctx.check_model(req.model)
    vocab = parts.engine.input_processor.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens has id(s) {bad[:5]} outside the vocabulary of {vocab}", "tokens")
    return {"prompt": parts.engine.tokenizer.decode(req.tokens)}
