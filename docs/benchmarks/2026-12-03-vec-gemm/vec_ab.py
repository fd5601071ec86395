"""A workload of ../shared/peers/common.py (W1 by default) on engines whose matmuls past the small-batch kernels
are the vector tile matmul (as built) or what ran before it on CPUs without AMX (oneDNN for bf16 past 8 rows; the
VNNI kernel up to 256 rows for quantized weights, then dequantized for oneDNN), side by side in one process and
run round-robin, so each shares the machine's speed of the moment. "Before" is the built layers with their
attributes set back after construction: the kernels it runs are the ones the engine still has.

    python vec_ab.py W1 bf16,bf16-before,int8,int8-before [rounds]
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.environ.get("PEERS_DIR", "/work/shared/peers"))
from common import make_prompts  # noqa: E402

import tokenmill.layers.linear as linear  # noqa: E402
import tokenmill.layers.quant.kernel as qkernel  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

BEFORE = False
_packed_init, _quant_init = linear.PackedWeight.__init__, qkernel.QuantLinearKernel.__init__


def packed_init(self, weight, bias):
    _packed_init(self, weight, bias)
    if BEFORE and self.tiles is not None:
        self.tile_max_rows, self.gated_on_tiles = linear.SKINNY_MAX_ROWS, False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def quant_init(self, qw, bias, dtype):
    _quant_init(self, qw, bias, dtype)
    if BEFORE and self.native:
        self.vnni_max_rows = self.max_rows = 256
        self.gated_on_tiles = False


linear.PackedWeight.__init__, qkernel.QuantLinearKernel.__init__ = packed_init, quant_init
from tokenmill.kernels import amx_available  # noqa: E402

assert not amx_available(), "this compares the paths of a CPU without AMX"


def make(mode: str) -> LLM:
    global BEFORE
    BEFORE = mode.endswith("-before")
    name = mode.removesuffix("-before")
    kw = dict(enable_prefix_caching=False, kv_cache_memory="2GiB")
    if name in ("int8", "int4", "gguf"):
        kw["quantization"] = name
    engine = LLM(**kw)
    BEFORE = False
    return engine


workload, modes = sys.argv[1], sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
engines = {m: make(m) for m in modes}
prompts, n = make_prompts(workload)
params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
for engine in engines.values():
    engine.generate([{"prompt_token_ids": list(range(100, 612))}], SamplingParams(max_tokens=8), use_tqdm=False)
for r in range(rounds):
    for m in modes if r % 2 == 0 else modes[::-1]:
        t = time.perf_counter()
        engines[m].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print(json.dumps(dict(round=r, mode=m, wall=round(time.perf_counter() - t, 2))), flush=True)
