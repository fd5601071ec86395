"""Chaos against a real server: a thousand requests cancelled at random moments (mid-prefill, mid-stream) leave
nothing behind. (A killed engine: tests/test_server.py.)"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
import requests
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

WORDS = "the cat sat on a mat while seven dogs ran past the old red barn near our quiet river town".split()


def gauges(server) -> dict[str, float]:
    out = {}
    for line in requests.get(server.url + "/metrics").text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"tokenmill:{name}"):
                out[name] = float(line.split()[-1])
    return out


async def one(session, url: str, rng: random.Random, counts: dict) -> None:
    stream = rng.random() < 0.6
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 10, 30, 120])))
    cut = rng.random() < 0.8   # four in five are cut off at a random moment, the rest may finish
    body = {"max_tokens": rng.randint(1, 16) if cut else rng.randint(1, 4),
            "temperature": rng.choice([0.0, 0.7, 1.2]), "stream": stream,
            "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 9)}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]

    async def call() -> None:
        async with session.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
            async for _ in r.content:
                pass

    try:
        await asyncio.wait_for(call(), timeout=rng.uniform(0.0, 0.4) if cut else 20.0)
        counts["completed"] += 1
    except asyncio.TimeoutError:
        counts["cancelled"] += 1


def test_a_thousand_random_cancellations_leave_nothing_behind():
    server = ServerProcess("--dtype", "bfloat16", "--kv-cache-memory", "128MiB", "--max-num-seqs", "32")
    try:
        counts = {"completed": 0, "cancelled": 0}

        async def run() -> None:
            rng = random.Random(17)
            sem = asyncio.Semaphore(32)
            async with aiohttp.ClientSession() as session:
                async def limited() -> None:
                    async with sem:
                        await one(session, server.url, random.Random(rng.random()), counts)

                await asyncio.gather(*(limited() for _ in range(1000)))

        asyncio.run(run())
        assert counts["completed"] + counts["cancelled"] == 1000
        assert counts["cancelled"] > 600 and counts["completed"] > 100, counts
        deadline = time.time() + 30
        while True:
            g = gauges(server)
            if g["num_requests_running"] == g["num_requests_waiting"] == g["kv_cache_usage_perc"] == 0:
                break
            assert time.time() < deadline, f"still in use after the cancellations: {g}"
            time.sleep(0.5)
        r = requests.post(server.url + "/v1/completions", json={"prompt": "Still fine?", "max_tokens": 4})
        assert r.status_code == 200
        print(f"chaos: {counts['cancelled']} cancelled, {counts['completed']} completed; KV usage back to 0")
    finally:
        server.stop()
