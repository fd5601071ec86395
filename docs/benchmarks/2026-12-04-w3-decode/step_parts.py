"""The parts of a W3 decode step on their own, 30 layers each (best of 7-20, ms): the matmuls at 64 and 128 rows
(SmolLM2's five linears on the vector tile kernel, lm head once), and the prompt kernel on the shared prefix as
the cascade runs it (64 decoded tokens x 9 heads against 1,024 keys, not causal, with log-sum-exps); with one query
row it is mostly the packing of the prefix's K and V.

    python docs/benchmarks/2026-12-04-w3-decode/step_parts.py
"""
import time

import torch

import tokenmill.kernels as kernels

torch.set_num_threads(2)
kernels.prefill_attention_op()   # builds or loads the kernels
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best(fn, reps: int, tries: int = 7) -> float:
    fn()
    out = 1e9
    for _ in range(tries):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out = min(out, (time.perf_counter() - t) / reps)
    return out


for rows in (64, 128):
    total_s = total_flop = 0.0
    for name, (n, k) in SHAPES.items():
        tiles = torch.ops.tokenmill.pack_tiles((torch.randn(n, k) * 0.05).bfloat16())
        x = torch.randn(rows, k).bfloat16()
        gated = name == "gate_up"
        s = best(lambda x=x, t=tiles, n=n, g=gated: torch.ops.tokenmill.vec_gemm(x, t, None, n, g),
                 3 if name == "lm_head" else 30)
        times = 1 if name == "lm_head" else 30
        total_s += s * times
        total_flop += 2 * rows * n * k * times
        print(f"{rows} rows {name}: {s * 1e3:.3f} ms, {2 * rows * n * k / s / 1e9:.0f} GFLOP/s")
    print(f"{rows} rows, a step's matmuls: {total_s * 1e3:.1f} ms, {total_flop / total_s / 1e9:.0f} GFLOP/s")

op = kernels.prefill_attention_op()
for queries, keys in ((64, 1024), (1, 1024)):
    q = torch.randn(queries, 9, 64).bfloat16()
    ks = [torch.randn(keys, 3, 64).bfloat16() for _ in range(30)]
    vs = [torch.randn(keys, 3, 64).bfloat16() for _ in range(30)]
    out, lse = torch.empty(queries, 9, 64).bfloat16(), torch.empty(queries, 9)
    s = best(lambda o=out, q=q, ks=ks, vs=vs, m=lse: [op(o, q, ks[i], vs[i], 0.125, 0, False, m) for i in range(30)],
             1, 20)
    flop = 30 * 4 * queries * 9 * keys * 64
    print(f"shared prefix, {queries} tokens x 9 heads against {keys} keys: {s * 1e3:.2f} ms, "
          f"{flop / s / 1e9:.0f} GFLOP/s")
