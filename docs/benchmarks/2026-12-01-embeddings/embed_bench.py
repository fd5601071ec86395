"""Embedding throughput: 256 requests of 256 random tokens each, (a) offline through LLM.embed in one call, (b)
through `tokenmill serve --pooler last` with 16 requests in flight; requests per second and prompt tokens per
second. bf16, the embedded SmolLM2.

    python docs/benchmarks/2026-12-01-embeddings/embed_bench.py [--num 256] [--len 256] [--port 8321]
    python docs/benchmarks/2026-12-01-embeddings/embed_bench.py --url http://127.0.0.1:8000   # any server (vLLM)
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def offline(ps) -> dict:
    from tokenmill import LLM

    llm = LLM(dtype="bfloat16", kv_cache_memory="1GiB", pooler="last")
    t = time.perf_counter()
    out = llm.embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)
    seconds = time.perf_counter() - t
    assert len(out) == len(ps) and all(len(o.outputs.embedding) == 576 for o in out)
    llm.shutdown()
    return {"seconds": round(seconds, 2), "requests_per_s": round(len(ps) / seconds, 2),
            "tokens_per_s": round(sum(map(len, ps)) / seconds)}


def served(ps, port: int, url: str | None = None) -> dict:
    """Against tokenmill started here, or (url) a server already running."""
    proc = None if url else subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli.main", "serve", "--port", str(port), "--pooler", "last", "--dtype",
         "bfloat16", "--kv-cache-memory", "1GiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = url or f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.2)

    def one(p):
        req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps({"input": p}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return len(json.loads(r.read())["data"][0]["embedding"])

    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            dims = list(pool.map(one, ps))
        seconds = time.perf_counter() - t
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    assert dims == [576] * len(ps)
    return {"seconds": round(seconds, 2), "requests_per_s": round(len(ps) / seconds, 2),
            "tokens_per_s": round(sum(map(len, ps)) / seconds)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--url", default=None, help="measure this running server only (the same 16-in-flight client)")
    ns = ap.parse_args()
    ps = prompts(ns.num, ns.len)
    if ns.url:
        print(json.dumps({f"server at {ns.url} (16 in flight)": served(ps, ns.port, ns.url)}, indent=1))
        return
    print(json.dumps({"offline": offline(ps), "server (16 in flight)": served(ps, ns.port)}, indent=1))


if __name__ == "__main__":
    main()
