"""Small helpers shared across the package."""

from __future__ import annotations

import logging
import re
import sys
import time

PROCESS_START = time.monotonic()   # (about) when this process started: the start-up log counts from it

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | float | str, field: str = "size") -> int:
    """Parse `4GiB`, `512MB`, `1e9` or an int into bytes; a ValueError names the field."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field} must be a number of bytes or a size like '4GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{field} must be positive, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def json_object(value, field: str) -> dict:
    """A JSON object given as text or already parsed; ValueError naming the field otherwise."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def init_logger(name: str) -> logging.Logger:
    """A logger under `tokenmill` with vLLM-like readable lines; TOKENMILL_LOG_LEVEL sets the level."""
    root = logging.getLogger("tokenmill")
    if not root.handlers:
        import os

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(module)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("TOKENMILL_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)
