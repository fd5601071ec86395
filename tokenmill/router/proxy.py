"""Forwarding one OpenAI request: pick a replica (prefix affinity, load), send the body, pass a stream through
byte for byte, retry once elsewhere on a refusal or a dead connection; with a prefill pool, compute the prompt on a
prefill instance first and point the decode instance at its KV blocks."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.router.autoscaler import Autoscaler
from tokenmill.router.backends import Backend, BackendPool
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import PrefixKeyer, Router
from tokenmill.utils import init_logger

logger = init_logger(__name__)

FORWARDED_REQUEST = ("authorization", "content-type", "x-request-id")
_FORWARDED_RESPONSE = ("content-type", "retry-after", "x-request-id")
# a replica that answers these before any byte went to the client is tried once elsewhere
_RETRY_STATUSES = (502, 503)


def router_error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """An OpenAI-style error body from the router itself (503s say when to retry)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


def forwarded_headers(raw: Request) -> dict[str, str]:
    return {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_REQUEST}


class Proxy:
    """The router's request path over its pools; the routes call `forward`."""

    def __init__(self, pool: BackendPool, keyer: PrefixKeyer | None, router: Router,
                 prefill_pool: BackendPool | None = None, metrics: RouterMetrics | None = None,
                 scaler: Autoscaler | None = None):
        self.pool, self.keyer, self.router, self.prefill_pool = pool, keyer, router, prefill_pool
        self.prefill_router = Router(router.load_factor)
        self.metrics = metrics or RouterMetrics()
        self.scaler = scaler   # with one, a request that finds no replica waits for one to start

    async def wait_for_replica(self) -> str | None:
        """Hold a request while no replica is in rotation and the autoscaler may start one: None once one is,
        else why not (the queue is full, or --queue-timeout passed)."""
        if self.scaler is None or self.pool.routable():
            return None
        held, config = self.scaler.held, self.scaler.config
        if held.count >= config.max_queued_requests:
            self.metrics.queue_timeouts.inc()
            return f"no replica is in rotation and {held.count} requests already wait for one"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.queue_timeout
        held.count += 1
        try:
            while not self.pool.routable():
                if loop.time() >= deadline:
                    held.timeouts += 1
                    self.metrics.queue_timeouts.inc()
                    return f"no replica came up within {config.queue_timeout:g} s"
                await asyncio.sleep(0.05)
            return None
        finally:
            held.count -= 1

    @property
    def pools(self) -> list[BackendPool]:
        return [self.pool] + ([self.prefill_pool] if self.prefill_pool is not None else [])

    async def forward(self, raw: Request, path: str, chat: bool):
        data = await raw.body()
        try:
            body = json.loads(data)
        except ValueError:
            body = None   # the replica answers the 400
        key = self.keyer.key_for(body, chat) if self.keyer is not None and isinstance(body, dict) else None
        headers = forwarded_headers(raw)
        problem = await self.wait_for_replica()
        if problem is not None:
            return router_error(503, problem, retry_after=5)
        if self.prefill_pool is not None and isinstance(body, dict):
            address = await self.prefill(path, body, key, headers)
            if address is not None:
                data = json.dumps({**body, "kv_transfer_params": {"remote_address": address}}).encode()
        tried: set[str] = set()
        model = body.get("model") if isinstance(body, dict) else None
        for attempt in range(2):
            decision = self.router.choose(self.serving(model), key, tried)
            if decision is None:
                break
            b = decision.backend
            tried.add(b.url)
            if attempt:
                self.metrics.retries.inc()
            self.metrics.decisions.labels(decision.reason).inc()
            if decision.cache_hit:
                self.metrics.affinity_hits.inc()
            self.metrics.requests.labels(b.url).inc()
            b.outstanding += 1
            resp = None
            try:
                resp = await self.pool.session.post(b.url + path, data=data, headers=headers)
                if resp.status in _RETRY_STATUSES and attempt == 0:
                    await resp.read()
                    raise _Retry(f"answered {resp.status}")
                if "text/event-stream" in resp.headers.get("content-type", ""):
                    return self._stream(resp, b)   # owns resp and the outstanding count from here
                content = await resp.read()
            except _Retry as e:
                logger.info("retrying a request elsewhere: %s %s", b.url, e)
                _release(resp, b)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.pool.mark_failed(b, f"{type(e).__name__}: {e}")
                _release(resp, b)
                continue
            _release(resp, b)
            return Response(content, status_code=resp.status, headers=_response_headers(resp, b))
        self.metrics.unrouted.inc()
        return router_error(503, "no replica is available to take the request", retry_after=1)

    def serving(self, model) -> list[Backend]:
        """The replicas in rotation that answer to `model` (a LoRA adapter may live on some only); all of them when
        none lists it, so the replica's own 404 reaches the client."""
        routable = self.pool.routable()
        if not isinstance(model, str):
            return routable
        known = [b for b in routable if b.models is not None and model in b.models]
        return known or routable

    async def models(self, headers: dict) -> dict | None:
        """Every routable replica's /v1/models merged by id, in the order first seen; None when none answered."""
        async def one(b: Backend):
            try:
                async with self.pool.session.get(b.url + "/v1/models", headers=headers) as r:
                    return (await r.json()).get("data", []) if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self.pool.mark_failed(b, f"{type(e).__name__}: {e}")
                return None

        answers = await asyncio.gather(*(one(b) for b in self.pool.routable()))
        if all(a is None for a in answers):
            return None
        merged: dict[str, dict] = {}
        for cards in answers:
            for card in cards or []:
                if isinstance(card, dict):
                    merged.setdefault(str(card.get("id")), card)
        return {"object": "list", "data": list(merged.values())}

    async def prefill(self, path: str, body: dict, key: bytes | None, headers: dict) -> str | None:
        """Compute the prompt on a prefill instance (the request cut to one token, not streamed); the address
        where that instance now serves its KV blocks, or None when no prefill succeeded."""
        decision = self.prefill_router.choose(self.prefill_pool.routable(), key)
        if decision is None:
            self.metrics.prefill_failures.inc()
            return None
        b = decision.backend
        one_token = {**body, "max_tokens": 1, "stream": False, "n": 1, "min_tokens": 0}
        one_token.pop("stream_options", None)
        if "max_completion_tokens" in one_token:
            one_token["max_completion_tokens"] = 1
        b.outstanding += 1
        try:
            async with self.pool.session.post(b.url + path, json=one_token, headers=headers) as r:
                await r.read()
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.prefill_pool.mark_failed(b, f"{type(e).__name__}: {e}")
            ok = False
        finally:
            b.outstanding -= 1
        if not ok or not b.kv_transfer:
            self.metrics.prefill_failures.inc()
            return None
        self.metrics.prefills.labels(b.url).inc()
        return b.kv_transfer["address"]

    def _stream(self, resp: aiohttp.ClientResponse, b: Backend) -> StreamingResponse:
        async def body():
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:   # the replica died mid-stream
                self.pool.mark_failed(b, f"{type(e).__name__}: {e}")
                err = {"error": {"message": "the replica serving this request failed", "type": "server_error",
                                 "param": None, "code": 502}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                _release(resp, b)

        headers = _response_headers(resp, b)
        headers.pop("Content-Type", None)
        return StreamingResponse(body(), status_code=resp.status, media_type="text/event-stream", headers=headers)


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
