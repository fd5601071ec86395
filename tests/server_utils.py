"""Start a real `tokenmill serve` process for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import requests


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
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log)
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
