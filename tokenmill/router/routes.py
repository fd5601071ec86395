"""The router's endpoints as FastAPI routers: the OpenAI routes it proxies, its own health, metrics and page (the
fleet at /), and the admin API of a rollout (add, drain and remove replicas). Handlers find the `Proxy` on
`request.app.state.proxy`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from tokenmill.router.backends import parse_backend
from tokenmill.router.proxy import Proxy, forwarded_headers, router_error
from tokenmill.utils import init_logger

logger = init_logger(__name__)

openai_routes = APIRouter()
health_routes = APIRouter()
admin_routes = APIRouter(prefix="/router")


def _proxy(raw: Request) -> Proxy:
    return raw.app.state.proxy


@openai_routes.post("/v1/completions")
async def completions(raw: Request):
    return await _proxy(raw).forward(raw, "/v1/completions", chat=False)


@openai_routes.post("/v1/chat/completions")
async def chat_completions(raw: Request):
    return await _proxy(raw).forward(raw, "/v1/chat/completions", chat=True)


@openai_routes.post("/v1/audio/transcriptions")
async def transcriptions(raw: Request):
    return await _proxy(raw).forward(raw, "/v1/audio/transcriptions", chat=False)   # (multipart, as it came)


@openai_routes.post("/v1/audio/translations")
async def translations(raw: Request):
    return await _proxy(raw).forward(raw, "/v1/audio/translations", chat=False)


@openai_routes.get("/v1/models")
async def models(raw: Request):
    """The models of all replicas in rotation merged (the base model, and each LoRA adapter any replica serves);
    scaled to zero, the request waits through a cold start like any other."""
    proxy = _proxy(raw)
    problem = await proxy.wait_for_replica()
    if problem is not None:
        return router_error(503, problem, retry_after=5)
    merged = await proxy.models(forwarded_headers(raw))
    if merged is None:
        return router_error(503, "no replica is available", retry_after=1)
    return merged


_PAGE = Path(__file__).resolve().parent / "static" / "index.html"


@health_routes.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page():
    """The fleet at a glance: each replica's state and load, the autoscaler's counts over the last minutes."""
    return HTMLResponse(_PAGE.read_text())


@health_routes.get("/health")
async def health(raw: Request):
    """Healthy while at least one replica is in rotation, or while an autoscaler can start one (scaled to zero,
    the router holds requests through the cold start)."""
    proxy = _proxy(raw)
    if proxy.pool.routable() or proxy.scaler is not None:
        return Response(status_code=200)
    return router_error(503, "no replica is in rotation", retry_after=1)


@health_routes.get("/metrics")
async def prometheus_metrics(raw: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    proxy = _proxy(raw)
    proxy.metrics.refresh(*proxy.pools)
    return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@admin_routes.get("/backends")
async def list_backends(raw: Request):
    proxy = _proxy(raw)
    out = {"backends": [b.describe() for b in proxy.pool.backends.values()]}
    if proxy.prefill_pool is not None:
        out["prefill"] = [b.describe() for b in proxy.prefill_pool.backends.values()]
    if proxy.scaler is not None:
        out["autoscaling"] = proxy.scaler.status()
    return out


@admin_routes.post("/backends")
async def add_backend(raw: Request):
    """{"url": ..., "weight": 1.0}: joins the rotation once its health check passes."""
    spec, pool = await _json(raw), _proxy(raw).pool
    try:
        b = pool.add(parse_backend(str(spec.get("url", "")), float(spec.get("weight", 1.0))))
    except (TypeError, ValueError) as e:
        return router_error(400, str(e))
    await pool.check(b)
    return b.describe()


@admin_routes.post("/drain")
async def drain(raw: Request):
    """{"url": ...}: no new requests go there; its in-flight ones finish. Answers when they have (or after
    `timeout` seconds, default 600) with what is left in flight."""
    spec = await _json(raw)
    b = _proxy(raw).pool.backends.get(str(spec.get("url", "")).rstrip("/"))
    if b is None:
        return router_error(404, f"no backend {spec.get('url')!r}")
    b.draining = True
    logger.info("draining %s (%d requests in flight)", b.url, b.outstanding)
    deadline = asyncio.get_running_loop().time() + float(spec.get("timeout", 600))
    while b.outstanding and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return b.describe()


@admin_routes.post("/remove")
async def remove(raw: Request):
    spec = await _json(raw)
    try:
        return _proxy(raw).pool.remove(str(spec.get("url", ""))).describe()
    except KeyError:
        return router_error(404, f"no backend {spec.get('url')!r}")


async def _json(raw: Request) -> dict:
    try:
        body = await raw.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
