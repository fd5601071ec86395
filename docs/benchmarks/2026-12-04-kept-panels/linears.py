"""The 120 linear layers of a SmolLM2-135M decode step (random weights of its shapes), bf16 against int8 and int4
(group 32) through the layers' own kernels, at the given batch sizes; rounds alternate the modes in one process
and the fastest of each is printed (this host's speed drifts within minutes).
    .venv/bin/python docs/benchmarks/2026-12-04-kept-panels/linears.py 12 128 2048
"""

from __future__ import annotations

import sys
import time

import torch

from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.methods import quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down: [N, K]


def main(rows_list: list[int], rounds: int = 7) -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.05
            layers.append((k, {"bf16": PackedWeight(w.bfloat16(), None),
                               "int8": QuantLinearKernel(quantize_int8(w), None, torch.bfloat16),
                               "int4": QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16)}))
    for m in rows_list:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        best = {mode: float("inf") for mode in ("bf16", "int8", "int4")}
        for _ in range(rounds):
            for mode in best:
                t0 = time.perf_counter()
                for k, kernels in layers:
                    kernels[mode](xs[k])
                best[mode] = min(best[mode], time.perf_counter() - t0)
        print(f"{m} rows: " + ", ".join(f"{mode} {t * 1e3:.2f} ms" for mode, t in best.items())
              + f"; int8/bf16 {best['int8'] / best['bf16']:.3f}, int4/bf16 {best['int4'] / best['bf16']:.3f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [128, 2048])
