"""Start a real `tokenmill serve` process for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import requests

# This process's CPUs before any in-process engine pinned its main thread to one of them: a server started later
# would inherit that single CPU (its engine, and a data-parallel server's second engine, would have one core).
_CPUS = os.sched_getaffinity(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, command: str = "serve", wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill.cli.main", command, "--port", str(self.port), *args]
        self.log = open(os.devnull, "w") if not os.environ.get("TOKENMILL_TEST_LOG") else None
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log,
                                     preexec_fn=lambda: os.sched_setaffinity(0, _CPUS))
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def engine_pid(self) -> int:
        """The engine-core process: a spawned child of the server, or (as `serve` starts it) a child of the
        server's fork server."""
        out = _children(self.proc.pid)
        for pid in out:
            cmdline = _cmdline(pid)
            if b"spawn_main" in cmdline:
                return pid
            if b"forkserver" in cmdline:
                forked = _children(pid)
                if forked:
                    return forked[0]
        raise RuntimeError(f"no engine-core child among {out}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log:
            self.log.close()


def kill_mid_stream(server: ServerProcess, victim, max_tokens: int) -> tuple[list, int, list[dict]]:
    """Start a streamed request, SIGKILL the process `victim()` names once tokens flow, and watch: the /health
    codes until the server exits, its exit code, and the error events the stream got."""
    import json
    import signal
    import threading

    events: list[bytes] = []
    started = threading.Event()

    def stream() -> None:
        r = requests.post(server.url + "/v1/completions", stream=True,
                          json={"prompt": "Go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
        for line in r.iter_lines():
            if line:
                events.append(line)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    os.kill(victim(), signal.SIGKILL)
    codes: list = []
    deadline = time.time() + 30
    while time.time() < deadline and server.proc.poll() is None:
        try:
            codes.append(requests.get(server.url + "/health", timeout=1).status_code)
        except requests.ConnectionError:
            codes.append(None)
        time.sleep(0.1)
    code = server.proc.wait(30)
    t.join(10)
    return codes, code, [json.loads(e.removeprefix(b"data: "))["error"] for e in events if b'"error"' in e]
