"""The API process's CPU per streamed token (issue 58), against the floor of the same HTTP stack: a bare uvicorn
ASGI app that streams chunks of the same size at the same pace (uvicorn with httptools and uvloop, as tokenmill).

The measure is utime + stime of the server's own process (/proc/PID/stat; the engine core is another process)
over streamed chat completions of TOKENS tokens (ignore_eos, temperature 0), divided by the SSE chunks received.
Streams run STREAMS at once; each row is one server, both measured back to back in this run.

    .venv/bin/python benchmarks/api_cpu.py [streams=1,8] [tokens=200] [requests=8] [out=FILE.jsonl]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

FLOOR_APP = r'''
import asyncio, json, sys, uvicorn
TOKENS, PACE = int(sys.argv[2]), float(sys.argv[3])
CHUNK = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1, "model": "smollm2",
         "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None, "finish_reason": None}]}
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(TOKENS):
        await asyncio.sleep(PACE)
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(CHUNK).encode() + b"\n\n",
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
uvicorn.run(app, port=int(sys.argv[1]), log_level="warning", loop="uvloop", http="httptools")
'''


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime (fields 14, 15)


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the server exited before it was ready") from None
            time.sleep(0.5)


def stream_one(port: int, tokens: int, counts: list[int]) -> None:
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    n = 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                n += 1
    counts.append(n)


def measure(port: int, pid: int, streams: int, tokens: int, requests: int) -> dict:
    stream_one(port, 8, [])   # (a first request warms what is lazy)
    before, t0, counts = cpu_seconds(pid), time.perf_counter(), []
    for _ in range(max(1, requests // streams)):
        threads = [threading.Thread(target=stream_one, args=(port, tokens, counts)) for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    cpu, chunks = cpu_seconds(pid) - before, sum(counts)
    return {"streams": streams, "chunks": chunks, "api_cpu_s": cpu, "wall_s": time.perf_counter() - t0,
            "ms_per_token": 1e3 * cpu / max(chunks, 1)}


def main() -> None:
    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    streams = [int(s) for s in opts.get("streams", "1,8").split(",")]
    tokens, requests = int(opts.get("tokens", 200)), int(opts.get("requests", 8))
    out = opts.get("out")
    py, rows = str(ROOT / ".venv" / "bin" / "python"), []
    servers = {
        "tokenmill": [str(ROOT / ".venv" / "bin" / "tokenmill"), "serve", "--port", "8131",
                      "--served-model-name", "smollm2"],
        "bare-uvicorn": [py, "-c", FLOOR_APP, "8132", str(tokens), "0.008"],
    }
    for name, cmd in servers.items():
        port = int(cmd[3])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_ready(port, proc)
            time.sleep(3 if name == "tokenmill" else 0.5)
            for s in streams:
                row = {"server": name, "tokens": tokens, **measure(port, proc.pid, s, tokens, requests)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(30)
    for s in streams:
        tm = next(r for r in rows if r["server"] == "tokenmill" and r["streams"] == s)
        floor = next(r for r in rows if r["server"] == "bare-uvicorn" and r["streams"] == s)
        print(f"{s} streams: tokenmill {tm['ms_per_token']:.3f} ms/token, bare uvicorn {floor['ms_per_token']:.3f}"
              f" ms/chunk, ratio {tm['ms_per_token'] / floor['ms_per_token']:.2f}")
    if out:
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
