"""The built-in page (a chat and the live engine view) and the data its engine view polls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.errors import error_response
from tokenmill.entrypoints.openai.routes.state import parts_of

router = APIRouter()
_PAGE = Path(__file__).resolve().parent.parent / "static" / "index.html"


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page():
    """Static: it holds no data, and its API calls carry the key."""
    return HTMLResponse(_PAGE.read_text())


@router.get("/v1/engine/state")
async def engine_state(raw: Request):
    """Each engine core's requests (progress, blocks), shared and cached free KV blocks, and the last minute's
    throughput, latencies and prefix-cache hit rate."""
    parts = parts_of(raw)
    try:
        states = await parts.engine.get_state()
    except (EngineDeadError, asyncio.TimeoutError):
        return error_response(503, "the engine core did not answer")
    return {"model": parts.ctx.served_model_name, "engines": [msgspec.to_builtins(s) for s in states],
            "recent": parts.recent.summary() if parts.recent is not None else None}
