"""How fast the first requests are once /health says ready: a 16-token completion the moment it answers 200, a
second right after, and a third 5 s later, over a few starts (start cache filled).

    python docs/benchmarks/2026-11-30-coldstart/first_requests.py [--tokenmill .venv/bin/tokenmill] [--starts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from cold_start import wait_healthy  # noqa: E402


def complete(port: int) -> float:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True}).encode()
    t0 = time.monotonic()
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                  {"content-type": "application/json"}), timeout=60).read()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenmill", default=".venv/bin/tokenmill")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--port", type=int, default=8320)
    ns = ap.parse_args()
    for _ in range(ns.starts):
        p = subprocess.Popen([ns.tokenmill, "serve", "--port", str(ns.port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        wait_healthy(p, ns.port)
        ready = time.monotonic() - t0
        first, second = complete(ns.port), complete(ns.port)
        time.sleep(5)
        later = complete(ns.port)
        print(f"ready {ready:5.2f} s   first {first:.3f} s   second {second:.3f} s   5 s later {later:.3f} s",
              flush=True)
        p.send_signal(signal.SIGINT)
        p.wait(60)


if __name__ == "__main__":
    main()
