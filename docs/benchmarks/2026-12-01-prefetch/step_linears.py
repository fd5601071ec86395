"""The 120 linears of one SmolLM2-135M decode step, for the matmul benchmarks beside this file: 30 layers of
distinct random weights (so they stream from memory as in a step), timed best of `reps` in ms."""
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def random_layers(make) -> dict[str, list]:
    """30 weights of each shape, each passed through `make` (a packing or a quantizer)."""
    torch.manual_seed(0)
    return {n: [make(torch.randn(*s) * 0.05) for _ in range(30)] for n, s in SHAPES.items()}


def best_ms(layers: dict[str, list], call, rows: int, reps: int = 6) -> float:
    """Best time of one pass of `call(weight, x)` over all 120 weights, with `rows` rows of bf16 input."""
    x = {n: torch.randn(rows, s[1]).bfloat16() for n, s in SHAPES.items()}
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(30):
            for n in SHAPES:
                call(layers[n][i], x[n])
        best = min(best, time.perf_counter() - t)
    return best * 1e3
