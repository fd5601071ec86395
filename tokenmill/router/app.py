"""The router's HTTP front: the OpenAI endpoints proxied to a chosen replica (`proxy.py`), its own /health and
/metrics, and an admin API to add, drain and remove replicas during a rollout (`routes.py`); an optional
autoscaler beside the pool starts and drains replicas on load (`autoscaler.py`)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.router.autoscaler import Autoscaler
from tokenmill.router.backends import BackendPool
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import PrefixKeyer, Router
from tokenmill.router.proxy import Proxy
from tokenmill.router.routes import admin_routes, health_routes, openai_routes


def build_router_app(pool: BackendPool, keyer: PrefixKeyer | None, router: Router | None = None,
                     backends_file: str | None = None, connect_timeout: float = 3.0,
                     admin_key: str | None = None, prefill_pool: BackendPool | None = None,
                     scaler: Autoscaler | None = None) -> FastAPI:
    """With a prefill_pool (disaggregated serving), each prompt is first computed on a prefill instance (one
    token), then the request goes to `pool`, the decode instances, which pull its KV blocks from there. With a
    scaler, the replicas it launches join `pool` and leave it, and requests wait for one when none is up."""
    metrics = scaler.metrics if scaler is not None and scaler.metrics is not None else RouterMetrics()
    if scaler is not None:
        scaler.metrics = metrics
    proxy = Proxy(pool, keyer, router or Router(), prefill_pool, metrics, scaler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout),
                                             auto_decompress=False)
        checkers = [asyncio.create_task(pool.health_loop(backends_file))]
        if prefill_pool is not None:
            prefill_pool.session = pool.session
            checkers.append(asyncio.create_task(prefill_pool.health_loop()))
        if scaler is not None:
            checkers.append(asyncio.create_task(scaler.run()))
        yield
        for checker in checkers:
            checker.cancel()
        if scaler is not None:
            await scaler.close()
        await pool.session.close()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.proxy = proxy

    @app.middleware("http")
    async def admin_auth(raw: Request, call_next):
        """The admin routes change what serves traffic: with a key set, they need it."""
        if admin_key and raw.url.path.startswith("/router/") and \
                raw.headers.get("authorization", "") != f"Bearer {admin_key}":
            return JSONResponse({"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                           "param": None, "code": 401}}, status_code=401)
        return await call_next(raw)

    for group in (openai_routes, health_routes, admin_routes):
        app.include_router(group)
    return app
