"""The server's own flags (the engine's come from EngineArgs)."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 opens it to the network).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="Require this bearer key on /v1 routes (or TOKENMILL_API_KEY).")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="Beyond max_num_seqs running, refuse new requests with 503 once this many are waiting.")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="On SIGTERM, seconds to let in-flight requests finish before they are aborted.")
    g.add_argument("--uvicorn-log-level", default="warning", help="Log level of uvicorn's own logger.")
