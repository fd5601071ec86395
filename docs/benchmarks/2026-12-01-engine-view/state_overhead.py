"""What the live engine view costs: W4 (64 requests of 256 random tokens, 128 out, all at once) against one
`tokenmill serve`, with and without a client polling GET /v1/engine/state 5 times a second, alternating runs;
output tokens/s of each.

    python docs/benchmarks/2026-12-01-engine-view/state_overhead.py [--runs 2] [--port 8331]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def wait_up(url: str) -> None:
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)


def poll(url: str, stop: threading.Event, counts: list) -> None:
    while not stop.is_set():
        t = time.monotonic()
        with urllib.request.urlopen(url + "/v1/engine/state", timeout=5) as r:
            json.loads(r.read())
        counts.append(time.monotonic() - t)
        stop.wait(max(0.0, 0.2 - (time.monotonic() - t)))


def one(url: str, polled: bool) -> dict:
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=poll, args=(url, stop, latencies)) if polled else None
    if poller:
        poller.start()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "bench", "serve", "--base-url", url,
                        "--workload", "W4", "--request-rate", "inf", "--output-json", f.name],
                       check=True, capture_output=True)
        result = json.load(open(f.name))
    stop.set()
    if poller:
        poller.join()
    out = {"output_tok_s": round(result["output_throughput"], 1), "itl_p99_ms": round(result["p99_itl_ms"], 1)}
    if polled:
        out["polls"] = len(latencies)
        out["poll_p50_ms"] = round(sorted(latencies)[len(latencies) // 2] * 1000, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--port", type=int, default=8331)
    ns = ap.parse_args()
    url = f"http://127.0.0.1:{ns.port}"
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "serve", "--port", str(ns.port),
                             "--dtype", "bfloat16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url)
        one(url, False)   # a first pass warms the server (its pages, the prefix cache stays cold: random prompts)
        results = {"off": [], "polled 5/s": []}
        for _ in range(ns.runs):
            results["off"].append(one(url, False))
            results["polled 5/s"].append(one(url, True))
        print(json.dumps(results, indent=1))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


if __name__ == "__main__":
    main()
