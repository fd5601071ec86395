"""`make soak`: a server under Poisson traffic at twice its measured capacity for ten minutes, with random
sampling parameters, a mix of lengths and clients that give up; it must refuse cleanly (503/429 with
Retry-After), finish what it accepts, fail nothing, and hold its memory.

    python -m tokenmill.bench.soak [--duration 600] [--overload 2.0] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np

WORDS = ("the a river town light north seven paper quiet market engine green stone winter music garden "
         "window story number simple").split()


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the engine core), MiB."""
    total = 0.0
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                   text=True).stdout.split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def random_body(rng: random.Random) -> tuple[str, dict, float | None]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice([8, 40, 200, 600])))
    body = {"max_tokens": rng.choice([8, 32, 128]), "temperature": rng.choice([0.0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([-1, 40]), "seed": rng.randint(0, 99),
            "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    give_up = rng.uniform(0.05, 2.0) if rng.random() < 0.1 else None   # one client in ten leaves early
    return path, body, give_up


async def one(session, url: str, rng: random.Random, counts: Counter, ttfts: list[float]) -> None:
    path, body, give_up = random_body(rng)
    t0 = time.perf_counter()

    async def call() -> None:
        async with session.post(url + path, json=body) as r:
            if r.status in (429, 503):
                counts["rejected"] += 1
                counts["rejected_with_retry_after"] += "Retry-After" in r.headers
                return
            if r.status != 200:
                counts[f"failed_{r.status}"] += 1
                return
            counts["accepted"] += 1
            first = True
            async for chunk in r.content.iter_any():
                if first and chunk:
                    ttfts.append(time.perf_counter() - t0)
                    first = False
                if b'"error"' in chunk:
                    counts["failed_in_stream"] += 1
                    return
            counts["completed"] += 1

    try:
        await asyncio.wait_for(call(), timeout=give_up or 600)
    except asyncio.TimeoutError:
        counts["cancelled"] += 1
    except aiohttp.ClientError:
        counts["failed_connection"] += 1


async def capacity(url: str, n: int = 24) -> float:
    """Requests a second the server finishes when it always has work: n of the soak's mix at once."""
    rng, counts, ttfts = random.Random(1), Counter(), []
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, url, random.Random(rng.random()), counts, ttfts) for _ in range(n)))
    return counts["completed"] / (time.perf_counter() - t0)


async def soak(url: str, rate: float, duration: float, pid: int) -> tuple[Counter, list[float], list[float]]:
    """Poisson arrivals for `duration` seconds; memory sampled every 10 s."""
    rng, counts, ttfts, tasks, memory = random.Random(7), Counter(), [], [], []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        end = start + duration
        while time.perf_counter() < end:
            if (time.perf_counter() - start) // 10 >= len(memory):
                memory.append(rss_mib(pid))
            tasks.append(asyncio.create_task(one(session, url, random.Random(rng.random()), counts, ttfts)))
            counts["sent"] += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return counts, ttfts, memory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of traffic.")
    p.add_argument("--overload", type=float, default=2.0, help="Arrival rate as a multiple of measured capacity.")
    p.add_argument("--port", type=int, default=8097)
    p.add_argument("--server-args", default="--kv-cache-memory 512MiB --max-num-seqs 16 --max-waiting-requests 16 "
                   "--request-timeout 120",
                   help="Extra flags for `tokenmill serve`.")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    url = f"http://127.0.0.1:{ns.port}"
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "serve", "--port", str(ns.port),
                               *ns.server_args.split()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import requests

        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        cap = asyncio.run(capacity(url))
        rate = ns.overload * cap
        print(f"capacity {cap:.2f} req/s; soaking at {rate:.2f} req/s for {ns.duration:.0f} s", flush=True)
        counts, ttfts, memory = asyncio.run(soak(url, rate, ns.duration, server.pid))
        time.sleep(2)
        # the first minute touches the KV cache's pages for the first time: memory is compared after it
        mem_start, mem_end = memory[min(6, len(memory) - 1)], rss_mib(server.pid)
        healthy = requests.get(url + "/health", timeout=5).status_code == 200
    finally:
        server.terminate()
        code = server.wait(60)
    failed = sum(v for k, v in counts.items() if k.startswith("failed"))
    report = {"capacity_req_s": round(cap, 3), "rate_req_s": round(rate, 3), "duration_s": ns.duration,
              **dict(counts), "failed": failed,
              "p99_ttft_s": round(float(np.percentile(ttfts, 99)), 3) if ttfts else None,
              "p50_ttft_s": round(float(np.percentile(ttfts, 50)), 3) if ttfts else None,
              "rss_mib_after_1_min": round(mem_start), "rss_mib_end": round(mem_end),
              "rss_mib_max": round(max(memory + [mem_end])),
              "rss_mib_every_10_s": [round(m) for m in memory], "healthy_at_end": healthy,
              "server_exit_code": code}
    print(json.dumps(report, indent=1))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(report, indent=1))
    return 0 if failed == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
