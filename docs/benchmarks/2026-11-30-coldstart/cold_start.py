"""Seconds from `tokenmill serve` to a 200 from /health on the embedded model: with the start cache empty (its
first start fills it), filled, and off; each start's log lines say where the seconds went.

    python docs/benchmarks/2026-11-30-coldstart/cold_start.py [--tokenmill .venv/bin/tokenmill] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request


def wait_healthy(p: subprocess.Popen, port: int) -> None:
    """Until /health on `port` answers 200; a server that exits first raises with its output."""
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            if p.poll() is not None:
                raise RuntimeError(p.stdout.read() if p.stdout else "the server exited during start-up") from None
            time.sleep(0.05)


def one_start(tokenmill: str, cache_dir: str, port: int = 8311, env: dict | None = None) -> tuple[float, list[str]]:
    env = {**os.environ, "TOKENMILL_CACHE_DIR": cache_dir, **(env or {})}
    t0 = time.monotonic()
    p = subprocess.Popen([tokenmill, "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_healthy(p, port)
    seconds = time.monotonic() - t0
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    return seconds, [line for line in out.splitlines() if "[metrics]" not in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenmill", default=".venv/bin/tokenmill")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        runs = [("cache empty", cache)] + [(f"cache filled #{i + 1}", cache) for i in range(ns.repeat)] + \
            [(f"cache off #{i + 1}", "off") for i in range(ns.repeat)]
        for name, cache_dir in runs:
            seconds, lines = one_start(ns.tokenmill, cache_dir)
            results[name] = {"seconds": round(seconds, 2), "log": lines}
            print(f"{name:18s} {seconds:6.2f} s")
            for line in lines:
                if any(k in line for k in ("[loader]", "allocated KV", "warm-up", "engine core ready", "ready in")):
                    print("    " + line.split("] ", 1)[-1])
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
