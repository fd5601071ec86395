"""The matmuls past the small-batch kernels on a CPU without AMX, at each row count, alternated in one process
(best of `reps` passes per round, best of the rounds, ms):
  - step: the 120 linears of a SmolLM2 step (30 layers of random weights, streamed from memory as in a step):
    bf16 on oneDNN's prepacked weight (what ran past 8 rows before) and on the vector tile matmul; int8 and int4
    (group 32) on the VNNI kernel, dequantized for oneDNN, and on the vector matmul over dequantized panels;
  - lm: the tied lm head (49,152 x 576), oneDNN against the vector matmul;
  - gated: 30 gate/up weights with silu(gate) * up after (oneDNN + silu_and_mul) or in the epilogue.

    python vec_rows.py step 1,8,16,32,64,128,256,512,2048
    python vec_rows.py lm,gated 9,16,32,64,128,256,512
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-01-prefetch"))
from step_linears import best_ms, random_layers  # noqa: E402

from tokenmill.kernels.build import load_cpu_kernels  # noqa: E402
from tokenmill.layers.quant import quantize_int4, quantize_int8  # noqa: E402
from tokenmill.layers.quant.kernel import QuantLinearKernel  # noqa: E402

load_cpu_kernels()
T = torch.ops.tokenmill


class Bf16:
    def __init__(self, w: torch.Tensor):
        w = w.bfloat16()
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w)
        self.tiles, self.n = T.pack_tiles(w), w.shape[0]


def onednn(p, x):
    return torch.ops.mkldnn._linear_pointwise(x, p.onednn, None, "none", [], "")


def vec(p, x):
    return T.vec_gemm(x, p.tiles, None, p.n)


def vnni(k, x):
    return T.quant_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)


def qvec(k, x):
    return T.quant_vec_gemm(x, k.q, k.scale, k.min, k.bias_f32, k.bits, k.group, k.out_features)


def dequant(k, x):
    return k._dequantized_matmul(x)


def best(f, reps):
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b * 1e3


parts, rows_list = sys.argv[1].split(","), [int(r) for r in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
if "step" in parts:
    bf = random_layers(Bf16)
    q8 = random_layers(lambda w: QuantLinearKernel(quantize_int8(w), None, torch.bfloat16))
    q4 = random_layers(lambda w: QuantLinearKernel(quantize_int4(w, 32), None, torch.bfloat16))
    for rows in rows_list:
        reps = 3 if rows <= 256 else 1
        row = {"part": "step", "rows": rows}
        cases = [("bf16_onednn", bf, onednn), ("bf16_vec", bf, vec)]
        for name, layers in (("int8", q8), ("int4", q4)):
            if rows <= 256:
                cases.append((name + "_vnni", layers, vnni))
            if rows >= 64:
                cases.append((name + "_dequant_onednn", layers, dequant))
            cases.append((name + "_vec", layers, qvec))
        for _ in range(rounds):
            for name, layers, f in cases:
                row[name] = min(row.get(name, 1e9), best_ms(layers, f, rows, reps))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
if "lm" in parts or "gated" in parts:
    torch.manual_seed(0)
    lm = Bf16(torch.randn(49152, 576) * 0.05)
    gus = [Bf16(torch.randn(3072, 576) * 0.05) for _ in range(30)]

    def onednn_gated(x):
        for g in gus:
            h = torch.empty(x.shape[0], 1536, dtype=torch.bfloat16)
            T.silu_and_mul(h, onednn(g, x))

    def vec_gated(x):
        for g in gus:
            T.vec_gemm(x, g.tiles, None, 3072, True)

    for rows in rows_list:
        x = torch.randn(rows, 576).bfloat16()
        row = {"part": "lm,gated", "rows": rows}
        calls = (("lm_onednn", lambda x: onednn(lm, x)), ("lm_vec", lambda x: vec(lm, x)),
                 ("gated_onednn", onednn_gated), ("gated_vec", vec_gated))
        for _ in range(rounds):
            for name, f in calls:
                row[name] = min(row.get(name, 1e9), best(lambda f=f, x=x: f(x), 3))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
