"""The router and its replicas' models (issue 58): `/v1/models` lists every model any replica in rotation answers
to (LoRA adapters on some replicas only included), and a request naming an adapter goes to a replica that serves
it. The replicas here are small aiohttp apps in a thread, each with its own list, so the test needs no engine."""

from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web
from fastapi.testclient import TestClient
from server_utils import free_port

from tokenmill.router.app import build_router_app
from tokenmill.router.backends import BackendPool, parse_backend


class FakeReplicas:
    """Replicas that answer /health, /load, /v1/models (their `models`, changeable while running) and
    /v1/completions with their own name, on loopback ports in a background event loop."""

    def __init__(self, models: dict[str, list[str]]):
        self.models = models
        self.ports = {name: free_port() for name in models}
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def _app(self, name: str) -> web.Application:
        async def health(_):
            return web.Response()

        async def load(_):
            return web.json_response({"waiting": 0, "kv_usage": 0.0})

        async def models(_):
            return web.json_response({"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "tokenmill"} for m in self.models[name]]})

        async def complete(request):
            body = await request.json()
            if body.get("model") not in self.models[name]:
                return web.json_response({"error": {"message": f"no model {body.get('model')}"}}, status=404)
            return web.json_response({"served_by": name, "model": body["model"]})

        app = web.Application()
        app.add_routes([web.get("/health", health), web.get("/load", load), web.get("/v1/models", models),
                        web.post("/v1/completions", complete)])
        return app

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runners = []
        for name, port in self.ports.items():
            runner = web.AppRunner(self._app(name))
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            runners.append(runner)
        self.ready.set()
        self.loop.run_forever()
        for runner in runners:
            self.loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("the condition did not come true in time")


def test_the_router_lists_every_replicas_adapters_and_routes_each_to_a_replica_that_serves_it():
    replicas = FakeReplicas({"a": ["base", "sql-lora"], "b": ["base"]})
    pool = BackendPool([parse_backend(replicas.url(n)) for n in ("a", "b")], health_interval=0.1)
    try:
        with TestClient(build_router_app(pool, None)) as client:
            _until(lambda: all(b.models is not None and b.healthy for b in pool.backends.values()))
            ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert ids == ["base", "sql-lora"]           # merged by id, each once
            answers = [client.post("/v1/completions", json={"model": "sql-lora", "prompt": "x"}) for _ in range(8)]
            assert {r.status_code for r in answers} == {200}, [r.text for r in answers]
            served = {r.json()["served_by"] for r in answers}
            assert served == {"a"}                       # only a has the adapter
            base = [client.post("/v1/completions", json={"model": "base", "prompt": "x"}) for _ in range(8)]
            assert {r.status_code for r in base} == {200}
            # an adapter loaded at run time on b shows up within a health interval, and b then takes its requests
            replicas.models["b"].append("chat-lora")
            _until(lambda: "chat-lora" in [m["id"] for m in client.get("/v1/models").json()["data"]])
            # routing follows the lists the health checks keep (the merged list above is fetched live)
            _until(lambda: "chat-lora" in (pool.backends[replicas.url("b")].models or ()))
            r = client.post("/v1/completions", json={"model": "chat-lora", "prompt": "x"})
            assert r.json()["served_by"] == "b" and r.headers["x-routed-to"] == replicas.url("b")
            # a model no replica lists reaches a replica, whose own 404 the client gets
            assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
            described = {b["url"]: b["models"] for b in client.get("/router/backends").json()["backends"]}
            assert described[replicas.url("a")] == ["base", "sql-lora"]
    finally:
        replicas.stop()
