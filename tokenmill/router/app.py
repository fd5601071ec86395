"""The router's HTTP front: the OpenAI endpoints proxied to a chosen replica (streams passed through byte for
byte), its own /health and /metrics, and an admin API to add, drain and remove replicas during a rollout."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.router.backends import Backend, BackendPool, parse_backend
from tokenmill.router.policy import PrefixKeyer, Router
from tokenmill.utils import init_logger

logger = init_logger(__name__)

_FORWARDED_REQUEST = ("authorization", "content-type", "x-request-id")
_FORWARDED_RESPONSE = ("content-type", "retry-after", "x-request-id")
# a replica that answers these before any byte went to the client is tried once elsewhere
_RETRY_STATUSES = (502, 503)


def _error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenmill_router:requests", "Requests sent to each replica", ["backend"], registry=r)
        self.retries = Counter("tokenmill_router:retries", "Requests retried on another replica", registry=r)
        self.decisions = Counter("tokenmill_router:routing_decisions", "Routing decisions by kind", ["decision"],
                                 registry=r)
        self.affinity_hits = Counter("tokenmill_router:cache_affinity_hits",
                                     "Requests sent where the previous request with their prefix went", registry=r)
        self.unrouted = Counter("tokenmill_router:unrouted_requests", "Requests no replica could take (503)",
                                registry=r)
        self.healthy = Gauge("tokenmill_router:backend_healthy", "1 while a replica is in rotation", ["backend"],
                             registry=r)
        self.outstanding = Gauge("tokenmill_router:backend_outstanding", "Requests in flight on each replica",
                                 ["backend"], registry=r)
        self.prefills = Counter("tokenmill_router:prefill_requests", "Prompts computed on a prefill instance and "
                                "handed to a decode instance", ["backend"], registry=r)
        self.prefill_failures = Counter("tokenmill_router:prefill_failures", "Prefills that failed (the decode "
                                        "instance then computed the prompt itself)", registry=r)

    def refresh(self, *pools: BackendPool) -> None:
        for b in (b for pool in pools for b in pool.backends.values()):
            self.healthy.labels(b.url).set(1 if b.routable else 0)
            self.outstanding.labels(b.url).set(b.outstanding)


def build_router_app(pool: BackendPool, keyer: PrefixKeyer | None, router: Router | None = None,
                     backends_file: str | None = None, connect_timeout: float = 3.0,
                     admin_key: str | None = None, prefill_pool: BackendPool | None = None) -> FastAPI:
    """With a prefill_pool (disaggregated serving), each prompt is first computed on a prefill instance (one
    token), then the request goes to `pool`, the decode instances, which pull its KV blocks from there."""
    router = router or Router()
    prefill_router = Router(router.load_factor)
    metrics = RouterMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout),
                                             auto_decompress=False)
        checkers = [asyncio.create_task(pool.health_loop(backends_file))]
        if prefill_pool is not None:
            prefill_pool.session = pool.session
            checkers.append(asyncio.create_task(prefill_pool.health_loop()))
        yield
        for checker in checkers:
            checker.cancel()
        await pool.session.close()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.pool, app.state.router = pool, router

    @app.middleware("http")
    async def admin_auth(raw: Request, call_next):
        """The admin routes change what serves traffic: with a key set, they need it."""
        if admin_key and raw.url.path.startswith("/router/") and \
                raw.headers.get("authorization", "") != f"Bearer {admin_key}":
            return JSONResponse({"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                           "param": None, "code": 401}}, status_code=401)
        return await call_next(raw)

    async def proxy(raw: Request, path: str, chat: bool):
        data = await raw.body()
        try:
            body = json.loads(data)
        except ValueError:
            body = None   # the replica answers the 400
        key = keyer.key_for(body, chat) if keyer is not None and isinstance(body, dict) else None
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_REQUEST}
        if prefill_pool is not None and isinstance(body, dict):
            address = await prefill(path, body, key, headers)
            if address is not None:
                data = json.dumps({**body, "kv_transfer_params": {"remote_address": address}}).encode()
        tried: set[str] = set()
        for attempt in range(2):
            decision = router.choose(pool.routable(), key, tried)
            if decision is None:
                break
            b = decision.backend
            tried.add(b.url)
            if attempt:
                metrics.retries.inc()
            metrics.decisions.labels(decision.reason).inc()
            if decision.cache_hit:
                metrics.affinity_hits.inc()
            metrics.requests.labels(b.url).inc()
            b.outstanding += 1
            resp = None
            try:
                resp = await pool.session.post(b.url + path, data=data, headers=headers)
                if resp.status in _RETRY_STATUSES and attempt == 0:
                    await resp.read()
                    raise _Retry(f"answered {resp.status}")
                if "text/event-stream" in resp.headers.get("content-type", ""):
                    return _stream(resp, b)   # owns resp and the outstanding count from here
                content = await resp.read()
            except _Retry as e:
                logger.info("retrying a request elsewhere: %s %s", b.url, e)
                _release(resp, b)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                pool.mark_failed(b, f"{type(e).__name__}: {e}")
                _release(resp, b)
                continue
            _release(resp, b)
            return Response(content, status_code=resp.status, headers=_response_headers(resp, b))
        metrics.unrouted.inc()
        return _error(503, "no replica is available to take the request", retry_after=1)

    async def prefill(path: str, body: dict, key: bytes | None, headers: dict) -> str | None:
        """Compute the prompt on a prefill instance (the request cut to one token, not streamed); the address
        where that instance now serves its KV blocks, or None when no prefill succeeded."""
        decision = prefill_router.choose(prefill_pool.routable(), key)
        if decision is None:
            metrics.prefill_failures.inc()
            return None
        b = decision.backend
        one_token = {**body, "max_tokens": 1, "stream": False, "n": 1, "min_tokens": 0}
        one_token.pop("stream_options", None)
        if "max_completion_tokens" in one_token:
            one_token["max_completion_tokens"] = 1
        b.outstanding += 1
        try:
            async with pool.session.post(b.url + path, json=one_token, headers=headers) as r:
                await r.read()
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            prefill_pool.mark_failed(b, f"{type(e).__name__}: {e}")
            ok = False
        finally:
            b.outstanding -= 1
        if not ok or not b.kv_transfer:
            metrics.prefill_failures.inc()
            return None
        metrics.prefills.labels(b.url).inc()
        return b.kv_transfer["address"]

    def _stream(resp: aiohttp.ClientResponse, b: Backend) -> StreamingResponse:
        async def body():
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:   # the replica died mid-stream
                pool.mark_failed(b, f"{type(e).__name__}: {e}")
                err = {"error": {"message": "the replica serving this request failed", "type": "server_error",
                                 "param": None, "code": 502}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                _release(resp, b)

        headers = _response_headers(resp, b)
        headers.pop("Content-Type", None)
        return StreamingResponse(body(), status_code=resp.status, media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await proxy(raw, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await proxy(raw, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(raw: Request):
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_REQUEST}
        for b in pool.routable():
            try:
                async with pool.session.get(b.url + "/v1/models", headers=headers) as r:
                    return Response(await r.read(), status_code=r.status, media_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                pool.mark_failed(b, str(e))
        return _error(503, "no replica is available", retry_after=1)

    @app.get("/health")
    async def health():
        """Healthy while at least one replica is in rotation."""
        if pool.routable():
            return Response(status_code=200)
        return _error(503, "no replica is in rotation", retry_after=1)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.refresh(pool, *([prefill_pool] if prefill_pool is not None else []))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- admin: the rollout steps -------------------------------------------------------------------------------
    @app.get("/router/backends")
    async def list_backends():
        out = {"backends": [b.describe() for b in pool.backends.values()]}
        if prefill_pool is not None:
            out["prefill"] = [b.describe() for b in prefill_pool.backends.values()]
        return out

    @app.post("/router/backends")
    async def add_backend(raw: Request):
        """{"url": ..., "weight": 1.0}: joins the rotation once its health check passes."""
        spec = await _json(raw)
        try:
            b = pool.add(parse_backend(str(spec.get("url", "")), float(spec.get("weight", 1.0))))
        except (TypeError, ValueError) as e:
            return _error(400, str(e))
        await pool.check(b)
        return b.describe()

    @app.post("/router/drain")
    async def drain(raw: Request):
        """{"url": ...}: no new requests go there; its in-flight ones finish. Answers when they have (or after
        `timeout` seconds, default 600) with what is left in flight."""
        spec = await _json(raw)
        b = pool.backends.get(str(spec.get("url", "")).rstrip("/"))
        if b is None:
            return _error(404, f"no backend {spec.get('url')!r}")
        b.draining = True
        logger.info("draining %s (%d requests in flight)", b.url, b.outstanding)
        deadline = asyncio.get_running_loop().time() + float(spec.get("timeout", 600))
        while b.outstanding and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return b.describe()

    @app.post("/router/remove")
    async def remove(raw: Request):
        spec = await _json(raw)
        try:
            return pool.remove(str(spec.get("url", ""))).describe()
        except KeyError:
            return _error(404, f"no backend {spec.get('url')!r}")

    return app


def _response_headers(resp: aiohttp.ClientResponse, b: Backend) -> dict[str, str]:
    """The replica's headers a client may need, and which replica answered (X-Routed-To)."""
    out = {k: v for k, v in resp.headers.items() if k.lower() in _FORWARDED_RESPONSE}
    out["X-Routed-To"] = b.url
    return out


class _Retry(Exception):
    pass


def _release(resp: aiohttp.ClientResponse | None, b: Backend) -> None:
    b.outstanding -= 1
    if resp is not None:
        resp.release()


async def _json(raw: Request) -> dict:
    try:
        body = await raw.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
