"""The replicas behind the router: their health, load and draining state, and the health checker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from tokenmill.utils import init_logger

logger = init_logger(__name__)


@dataclass
class Backend:
    url: str
    weight: float = 1.0
    healthy: bool = False        # until the first health check passes
    draining: bool = False       # takes no new requests; in-flight ones finish
    outstanding: int = 0         # requests the router has in flight on it
    waiting: int = 0             # its engine's waiting queue, from its /load
    kv_usage: float = 0.0
    last_error: str = ""
    kv_transfer: dict | None = None   # from its /load: role, address and block layout (disaggregated serving)
    role: str | None = None           # set by a disaggregating router: "prefill" or "decode"
    starting: bool = False            # launched by the autoscaler, not yet healthy once
    models: frozenset[str] | None = None   # the model ids it answers to (base and LoRA adapters), from /v1/models

    @property
    def state(self) -> str:
        """starting (cold start), healthy (in rotation), draining, unhealthy (failed its last check) or parked
        (weight 0)."""
        if self.draining:
            return "draining"
        if self.starting and not self.healthy:
            return "starting"
        if not self.healthy:
            return "unhealthy"
        return "healthy" if self.weight > 0 else "parked"

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.weight > 0

    def load(self) -> float:
        """What the least-loaded choice compares: requests in flight plus the replica's own queue, per weight."""
        return (self.outstanding + self.waiting) / self.weight

    def describe(self) -> dict:
        return {"url": self.url, "state": self.state, "weight": self.weight, "healthy": self.healthy,
                "draining": self.draining,
                "outstanding": self.outstanding, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "last_error": self.last_error, "models": sorted(self.models) if self.models is not None else None}


def parse_backend(spec: str, weight: float = 1.0) -> Backend:
    """'http://host:port' (a trailing slash is dropped); a weight of 0 keeps it out of rotation."""
    url = spec.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--backend must be an http(s) URL, got {spec!r}")
    if weight < 0:
        raise ValueError(f"--weight must not be negative, got {weight}")
    return Backend(url, weight)


def read_backends_file(path: str) -> list[Backend]:
    """One backend a line: 'URL [WEIGHT]'; blank lines and # comments are skipped."""
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split("#", 1)[0].split()
            if parts:
                out.append(parse_backend(parts[0], float(parts[1]) if len(parts) > 1 else 1.0))
    return out


class BackendPool:
    def __init__(self, backends: list[Backend], health_interval: float = 1.0, timeout: float = 2.0,
                 pairing: dict | None = None):
        self.backends: dict[str, Backend] = {b.url: b for b in backends}
        # disaggregated serving: the prefill and decode pools share this, {"layout": the KV layout all must have}
        self.pairing = pairing if pairing is not None else {}
        self.health_interval, self.timeout = health_interval, timeout
        self.session: aiohttp.ClientSession | None = None

    def routable(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.routable]

    def add(self, backend: Backend) -> Backend:
        existing = self.backends.get(backend.url)
        if existing is not None:
            existing.weight, existing.draining = backend.weight, False
            return existing
        self.backends[backend.url] = backend
        logger.info("backend added: %s (weight %g)", backend.url, backend.weight)
        return backend

    def remove(self, url: str) -> Backend:
        backend = self.backends.pop(url.rstrip("/"), None)
        if backend is None:
            raise KeyError(url)
        logger.info("backend removed: %s (%d requests still in flight)", url, backend.outstanding)
        return backend

    def sync(self, wanted: list[Backend]) -> None:
        """The backends a re-read file lists: new ones join, missing ones leave, weights update."""
        urls = {b.url for b in wanted}
        for url in [u for u in self.backends if u not in urls]:
            self.remove(url)
        for b in wanted:
            self.add(b)

    def pairing_problem(self, backend: Backend) -> str | None:
        """Why a prefill or decode instance cannot take part (wrong role, another KV layout), or None. The first
        instance seen sets the layout the others must match."""
        from tokenmill.kv_transfer.layout import layout_mismatch

        kv = backend.kv_transfer
        wanted = ("kv_producer", "kv_both") if backend.role == "prefill" else ("kv_consumer", "kv_both")
        if not kv or kv.get("role") not in wanted:
            return (f"a {backend.role} instance needs --kv-transfer-config with kv_role {' or '.join(wanted)}; "
                    f"it has {kv.get('role') if kv else 'none'}")
        if self.pairing.get("layout") is None:
            self.pairing["layout"] = kv.get("layout")
        mismatch = layout_mismatch(self.pairing["layout"], kv.get("layout") or {})
        return f"its KV block layout differs from the others' ({mismatch})" if mismatch else None

    def mark_failed(self, backend: Backend, error: str) -> None:
        """A connection failure takes a backend out of rotation until its next health check passes."""
        if backend.healthy:
            logger.warning("backend %s left the rotation: %s", backend.url, error)
        backend.healthy, backend.last_error = False, error

    async def check(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with self.session.get(backend.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
                error = "" if ok else f"/health answered {r.status}"
            if ok:
                async with self.session.get(backend.url + "/load", timeout=timeout) as r:
                    if r.status == 200:
                        load = await r.json()
                        backend.waiting = int(load.get("waiting", 0))
                        backend.kv_usage = float(load.get("kv_usage", 0.0))
                        backend.kv_transfer = load.get("kv_transfer")
                        problem = self.pairing_problem(backend) if backend.role else None
                        if problem:
                            ok, error = False, problem
                await self.refresh_models(backend, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            ok, error = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if ok and not backend.healthy:
            logger.info("backend %s is healthy: in rotation", backend.url)
            backend.starting = False
        elif not ok and backend.healthy:
            logger.warning("backend %s left the rotation: %s", backend.url, error)
        backend.healthy, backend.last_error = ok, error

    async def refresh_models(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        """Its model ids, so a request naming a LoRA adapter goes to a replica that serves it (adapters loaded at
        run time show up within a health interval). A replica without the route keeps an unknown list."""
        async with self.session.get(backend.url + "/v1/models", timeout=timeout) as r:
            if r.status == 200:
                cards = (await r.json()).get("data", [])
                backend.models = frozenset(str(c.get("id")) for c in cards if isinstance(c, dict))

    async def health_loop(self, backends_file: str | None = None) -> None:
        while True:
            if backends_file:
                try:
                    self.sync(read_backends_file(backends_file))
                except (OSError, ValueError) as e:
                    logger.warning("could not re-read %s: %s", backends_file, e)
            await asyncio.gather(*(self.check(b) for b in list(self.backends.values())))
            await asyncio.sleep(self.health_interval)
