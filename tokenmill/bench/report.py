"""Printing and saving benchmark results."""

from __future__ import annotations

import json
import time

import numpy as np


def percentiles(values_s: list[float], name: str, pcts=(50, 90, 99)) -> dict[str, float]:
    """mean/median/pN of a list of seconds, reported in ms under vLLM's key names."""
    if not values_s:
        return {}
    ms = np.asarray(values_s) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    for p in pcts:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def emit(result: dict, title: str, output_json: str | None) -> None:
    result.setdefault("date", time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"{'=' * 16} {title} {'=' * 16}")
    for key, value in result.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            print(f"{key:<36} {value:.2f}" if isinstance(value, float) else f"{key:<36} {value}")
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved to {output_json}")
