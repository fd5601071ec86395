"""`tokenmill router` in front of real `tokenmill serve` replicas (a tiny random model, so they start fast):
prefix affinity shows in the replicas' prefix-cache hits, a killed replica costs no request, a rollout swap
under steady load fails none, and a router with no live replica answers 503 with Retry-After instead of
hanging."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import requests
from server_utils import ServerProcess, free_port


def _replica(folder, wait: bool = True, *extra: str) -> ServerProcess:
    return ServerProcess(str(folder), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-seqs", "16",
                         *extra, wait=wait)


def _kv_both() -> tuple[str, str]:
    """A replica that can both serve and pull KV blocks: plain traffic is unchanged, and the same two replicas
    serve the disaggregated test as a prefill and a decode instance."""
    config = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": free_port()}
    return "--kv-transfer-config", json.dumps(config)


def _router(folder, *backends: ServerProcess) -> ServerProcess:
    args = [a for b in backends for a in ("--backend", b.url)]
    return ServerProcess("--host", "127.0.0.1", "--model", str(folder), "--health-interval", "0.3", *args,
                         command="router")


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _outstanding(router_url: str, backend_url: str) -> int:
    backends = requests.get(router_url + "/router/backends").json()["backends"]
    return next(x["outstanding"] for x in backends if x["url"] == backend_url)


def _complete(url: str, prompt, max_tokens: int = 4, **extra) -> requests.Response:
    return requests.post(url + "/v1/completions", timeout=120,
                         json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra})


@dataclass
class Cluster:
    folder: object
    router: ServerProcess
    replicas: list[ServerProcess]   # every replica started, in order (the fixture stops them all)

    def in_rotation(self) -> list[ServerProcess]:
        urls = {x["url"] for x in requests.get(self.router.url + "/router/backends").json()["backends"]
                if x["healthy"]}
        return [r for r in self.replicas if r.url in urls]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    folder = tiny_model_dir("llama")
    a, b = _replica(folder, False, *_kv_both()), _replica(folder, False, *_kv_both())
    a.wait_healthy()
    b.wait_healthy()
    c = Cluster(folder, _router(folder, a, b), [a, b])
    deadline = time.time() + 30
    while len(c.in_rotation()) < 2:
        assert time.time() < deadline, "the replicas never joined the rotation"
        time.sleep(0.2)
    yield c
    for s in (c.router, *c.replicas):
        s.stop()


def test_requests_sharing_a_prefix_land_on_one_replica(cluster):
    router, (a, b) = cluster.router, cluster.in_rotation()
    prefixes = [[1000 + i for i in range(80)], [5000 + i for i in range(80)]]   # 5 blocks each
    hits_before = {s.url: _metric(s.url, "tokenmill:prefix_cache_hits_total") for s in (a, b)}
    landed: dict[int, set[str]] = {0: set(), 1: set()}
    for i in range(6):
        for p, prefix in enumerate(prefixes):
            r = _complete(router.url, prefix + [300 + i, 301 + i])
            assert r.status_code == 200, r.text
            landed[p].add(r.headers["x-routed-to"])
    assert all(len(urls) == 1 for urls in landed.values()), landed
    # each replica that took a prefix served its later requests from its prefix cache (5 blocks = 80 tokens each)
    for urls in landed.values():
        url = next(iter(urls))
        assert _metric(url, "tokenmill:prefix_cache_hits_total") - hits_before[url] >= 5 * 80
    assert _metric(router.url, "tokenmill_router:cache_affinity_hits_total") >= 10
    # streaming goes through untouched, to the same replica
    r = requests.post(router.url + "/v1/completions", stream=True, timeout=60,
                      json={"prompt": prefixes[0] + [7], "max_tokens": 3, "ignore_eos": True, "stream": True})
    events = [line for line in r.iter_lines() if line]
    assert r.headers["x-routed-to"] in landed[0] and events[-1] == b"data: [DONE]" and len(events) == 4


def test_disaggregated_prefill_then_decode_answers_as_one_instance(cluster):
    """`router --prefill A --decode B`: each prompt is computed on A, its blocks pulled by B, which generates; the
    answers equal A's own (fp32 greedy), B's prefix-cache hits show the pulled blocks, streaming passes through."""
    a, b = cluster.replicas[:2]
    router = ServerProcess("--host", "127.0.0.1", "--model", str(cluster.folder), "--health-interval", "0.3",
                           "--prefill", a.url, "--decode", b.url, command="router")
    try:
        prompts = [[(7919 * (i + 1) + 31 * j) % 40000 + 100 for j in range(70 + 9 * i)] for i in range(3)]
        alone = [_complete(a.url, p, 16, temperature=0).json()["choices"][0]["text"] for p in prompts]
        hits = _metric(b.url, "tokenmill:prefix_cache_hits_total")
        split = [_complete(router.url, p, 16, temperature=0).json()["choices"][0]["text"] for p in prompts]
        assert split == alone
        assert _metric(b.url, "tokenmill:prefix_cache_hits_total") - hits >= sum((len(p) - 1) // 16 * 16
                                                                                 for p in prompts)
        assert _metric(router.url, "tokenmill_router:prefill_requests_total") == 3
        stream = _complete(router.url, prompts[0], 16, temperature=0, stream=True)
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.text.splitlines()
                       if line.startswith("data: {"))
        assert text == alone[0]
    finally:
        router.stop()


@pytest.mark.slow
def test_a_rollout_swap_under_steady_load_fails_no_request(cluster):
    """Start a new replica, add it, drain the old one (in-flight requests finish), remove and stop it, while
    three clients send requests back to back."""
    router, (a, b) = cluster.router, cluster.in_rotation()
    failures, done, stop = [], [0], threading.Event()

    def client(seed: int) -> None:
        i = 0
        while not stop.is_set():
            r = _complete(router.url, [200 + seed, 400 + i % 50, 7], max_tokens=8)
            if r.status_code != 200:
                failures.append((r.status_code, r.text[:200]))
            done[0] += 1
            i += 1

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        new = _replica(cluster.folder)
        cluster.replicas.append(new)
        assert requests.post(router.url + "/router/backends", json={"url": new.url}).json()["healthy"]
        drained = requests.post(router.url + "/router/drain", json={"url": a.url}, timeout=120).json()
        assert drained["outstanding"] == 0
        requests.post(router.url + "/router/remove", json={"url": a.url}).raise_for_status()
        a.stop()
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert done[0] > 20 and failures == [], failures[:3]
    urls = {x["url"] for x in requests.get(router.url + "/router/backends").json()["backends"]}
    assert urls == {b.url, new.url}


def test_a_killed_replica_costs_no_request(cluster):
    """Non-streamed requests spread over two replicas; one is SIGKILLed mid-load: the ones it held are retried
    on the other (nothing had reached their clients yet), so every request is answered; and the killed replica's
    engine core (forked from its fork server, so not its child) stops rather than living on."""
    router, (_, other) = cluster.router, cluster.in_rotation()
    engine = other.engine_pid()
    results: list[int] = []

    def send(i: int) -> None:
        results.append(_complete(router.url, [900 + i, 17, 18], max_tokens=300).status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while _outstanding(router.url, other.url) < 3:   # it holds some of them, unfinished
        assert time.time() < deadline
        time.sleep(0.05)
    other.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    other.stop()
    assert results == [200] * 12, results
    assert _metric(router.url, "tokenmill_router:retries_total") >= 1
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{engine}") and _state(engine) != "Z" and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{engine}") or _state(engine) == "Z", "the engine core outlived its server"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_no_live_replica_is_a_503_with_retry_after():
    """A backend that accepts connections but never answers, and one whose port is closed: neither enters the
    rotation, and the router answers at once instead of hanging."""
    import socket

    from fastapi.testclient import TestClient

    from tokenmill.router.app import build_router_app
    from tokenmill.router.backends import BackendPool, parse_backend

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)   # accepts, never reads or answers
    dead = f"http://127.0.0.1:{free_port()}"
    pool = BackendPool([parse_backend(f"http://127.0.0.1:{silent.getsockname()[1]}"), parse_backend(dead)],
                       health_interval=0.2, timeout=0.5)
    try:
        with TestClient(build_router_app(pool, None)) as client:
            time.sleep(1.0)
            assert client.get("/health").status_code == 503
            t0 = time.time()
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert time.time() - t0 < 2
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == 503
            backends = client.get("/router/backends").json()["backends"]
            assert not any(x["healthy"] for x in backends) and all(x["last_error"] for x in backends)
    finally:
        silent.close()


@pytest.mark.slow
def test_data_parallel_engines_behind_one_api_server(cluster):
    """`serve -dp 2`: two engine cores under one API server; repeats of a prompt meet on the engine that cached it
    (every repeat's 4 leading blocks hit), the answers are the single-engine replica's, and the gauges sum."""
    server = _replica(cluster.folder, True, "--data-parallel-size", "2")
    try:
        engines = [p for p in _children_of(server.proc.pid) if p != server.proc.pid]
        prompts = [[(7919 * (i + 1) + 31 * j) % 40000 + 100 for j in range(70)] for i in range(3)]
        reference = cluster.in_rotation()[0]   # (earlier tests swapped and killed replicas)
        alone = [_complete(reference.url, p, 8, temperature=0).json()["choices"][0]["text"] for p in prompts]
        for _ in range(3):
            assert [_complete(server.url, p, 8, temperature=0).json()["choices"][0]["text"] for p in prompts] == alone
        assert _metric(server.url, "tokenmill:prefix_cache_hits_total") == 6 * 64
        assert len(engines) >= 3   # the fork server and the two engine cores forked from it
    finally:
        server.stop()


def _children_of(pid: int) -> list[int]:
    """Every process under pid (the fork server and the engine cores it forked)."""
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [c for p in map(int, out) for c in (p, *_children_of(p))]


@pytest.mark.slow   # 21 s of real replica starts; test_autoscaler.py checks the same decisions with fake launchers
def test_autoscaling_from_zero_through_a_burst_and_back_to_zero(tiny_model_dir):
    """`--min-replicas 0 --max-replicas 2`: the router is healthy with no replica; a first request waits through a
    cold start and is answered; 16 clients in a loop bring a second replica, which then serves some of them; idle,
    the fleet drains back to zero with the replica processes gone. No request fails on the way."""
    folder = tiny_model_dir("llama")
    base = free_port()
    router = ServerProcess(
        "--host", "127.0.0.1", "--model", str(folder), "--health-interval", "0.3", "--min-replicas", "0",
        "--max-replicas", "2", "--target-ongoing-requests", "4", "--upscale-delay", "0.5", "--downscale-delay", "3",
        "--downscale-to-zero-delay", "2", "--replica-port-base", str(base), "--replica-args",
        f"{folder} --dtype float32 --kv-cache-memory 16MiB --max-num-seqs 4", command="router")
    replica_urls = {f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"}

    def scaling() -> dict:
        return requests.get(router.url + "/router/backends").json()

    try:
        assert scaling()["backends"] == [] and scaling()["autoscaling"]["current_replicas"] == 0
        r = _complete(router.url, "a first request on zero replicas", 4)
        assert r.status_code == 200 and r.headers["x-routed-to"] in replica_urls
        stop, failures, routed_to = threading.Event(), [], set()

        def client(i: int) -> None:
            while not stop.is_set():
                resp = _complete(router.url, f"client {i} asks again " * 4, 24)
                if resp.status_code != 200:
                    failures.append(resp.text)
                routed_to.add(resp.headers.get("x-routed-to"))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in clients:
            t.start()
        deadline, peak = time.time() + 90, 0
        while len(routed_to) < 2 and time.time() < deadline:
            peak = max(peak, scaling()["autoscaling"]["current_replicas"])
            time.sleep(0.2)
        stop.set()
        for t in clients:
            t.join()
        assert not failures and routed_to == replica_urls and max(peak, 2) == 2
        assert _metric(router.url, "tokenmill_router:scaling_decisions_total") >= 2
        deadline = time.time() + 60
        while scaling()["backends"] and time.time() < deadline:
            time.sleep(0.3)
        assert scaling()["backends"] == [] and scaling()["autoscaling"]["current_replicas"] == 0
        assert _children_of(router.proc.pid) == []
        for url in replica_urls:
            with pytest.raises(requests.ConnectionError):
                requests.get(url + "/health", timeout=2)
        assert requests.get(router.url + "/health").status_code == 200
    finally:
        router.stop()
