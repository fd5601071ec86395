"""Arithmetic floors of W1, W3 and W2's TTFT for the embedded SmolLM2-135M on this machine: each workload's
multiply-adds (linears, lm head rows, attention scores and values), divided by the fastest bf16 matmul rate
measured here at that moment (oneDNN's F.linear and tokenmill's own packed matmul, each linear shape at the
batch sizes the workloads run). A time under the floor needs the whole workload -- norms, rope, softmax,
KV writes and reads, sampling and the host included -- faster than the machine's best matmul.

    .venv/bin/python docs/benchmarks/2026-12-04-floors/floors.py [VLLM_W1_S VLLM_W3_S]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

L, H, I, HQ, HKV, D, V = 30, 576, 1536, 9, 3, 64, 49152     # SmolLM2-135M (the embedded GGUF's config)
SHAPES = {"qkv": ((HQ + 2 * HKV) * D, H), "o": (H, HQ * D), "gate_up": (2 * I, H), "down": (H, I)}
LINEAR_MACS = L * sum(n * k for n, k in SHAPES.values())    # a token through every layer's linears
HEAD_MACS = H * V
ATTN_MACS_PER_KEY = L * HQ * D * 2                          # q.k and p.v for one query token and one key


def workload_flops() -> dict[str, float]:
    def prompt(n: int, context: int = 0) -> float:   # n new tokens after `context` cached ones, causal
        keys = sum(context + j + 1 for j in range(n))
        return 2 * (n * LINEAR_MACS + keys * ATTN_MACS_PER_KEY + HEAD_MACS)   # (the last row's logits)

    def decode(context: int) -> float:                # one token with `context` keys before it
        return 2 * (LINEAR_MACS + HEAD_MACS + (context + 1) * ATTN_MACS_PER_KEY)

    w1 = 128 * (prompt(256) + sum(decode(256 + t) for t in range(127)))
    w3 = prompt(1024) + 64 * (prompt(32, 1024) + sum(decode(1056 + t) for t in range(63)))
    return {"W1": w1, "W3": w3, "W2 TTFT": prompt(128)}


def best_rate(rows: int, reps: int = 10) -> tuple[float, str]:
    from tokenmill.layers.linear import PackedWeight

    best, who = 0.0, ""
    for name, (n, k) in SHAPES.items():
        w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
        for label, fn in (("oneDNN", lambda: F.linear(x, w)), ("tokenmill", PackedWeight(w, None).__call__)):
            if label == "tokenmill":
                kernel = fn
                fn = lambda kernel=kernel: kernel(x)   # noqa: E731
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            rate = 2 * rows * n * k * reps / (time.perf_counter() - t0)
            if rate > best:
                best, who = rate, f"{label} {name} at {rows} rows"
    return best, who


def main() -> None:
    torch.set_num_threads(2)
    rate, who = max(best_rate(rows) for rows in (128, 512, 2048))
    print(f"fastest bf16 matmul here now: {rate / 1e9:.0f} GFLOP/s ({who})")
    vllm = dict(zip(("W1", "W3"), map(float, sys.argv[1:3]))) if len(sys.argv) > 2 else {}
    targets = {"W1": 0.6, "W3": 0.5}
    for name, flops in workload_flops().items():
        floor = flops / rate
        line = f"{name}: {flops / 1e12:.2f} TFLOP, floor {floor * 1e3:.1f} ms" if name == "W2 TTFT" else \
            f"{name}: {flops / 1e12:.2f} TFLOP, floor {floor:.2f} s"
        if name in vllm:
            line += f"; target {targets[name]} x vLLM's {vllm[name]:.2f} s = {targets[name] * vllm[name]:.2f} s"
        print(line)


if __name__ == "__main__":
    main()
