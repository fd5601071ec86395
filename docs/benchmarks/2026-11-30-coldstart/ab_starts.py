"""Cold starts of two versions of tokenmill, alternated in one window (the host's speed drifts): `before` runs
the tokenmill of another checkout (put first on PYTHONPATH; the editable install's finder comes after it),
`after` this one, both with the start cache filled.

    git worktree add /tmp/before <commit>
    python docs/benchmarks/2026-11-30-coldstart/ab_starts.py --before /tmp/before --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from cold_start import one_start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="A checkout of the earlier commit.")
    ap.add_argument("--tokenmill", default=".venv/bin/tokenmill")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tokenmill"))
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    one_start(ns.tokenmill, ns.cache_dir)   # fills the cache (and the page cache); not counted
    results: dict[str, list[float]] = {"before": [], "after": []}
    logs: dict[str, list[list[str]]] = {"before": [], "after": []}
    for i in range(ns.pairs):
        for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
            env = {"PYTHONPATH": ns.before} if name == "before" else {}
            seconds, lines = one_start(ns.tokenmill, ns.cache_dir, env=env)
            results[name].append(round(seconds, 2))
            logs[name].append(lines)
            ready = [line.split("] ", 1)[-1] for line in lines if "engine core ready" in line]
            print(f"{name:7s} {seconds:6.2f} s   {ready[0] if ready else ''}", flush=True)
    for name, xs in results.items():
        print(f"{name}: median {statistics.median(xs):.2f} s, min {min(xs):.2f}, max {max(xs):.2f}: {xs}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"seconds": results, "logs": logs}, f, indent=1)


if __name__ == "__main__":
    main()
