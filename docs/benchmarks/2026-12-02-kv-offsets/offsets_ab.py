"""Perplexity of the quantized KV caches with and without the K offsets, each through the engine as
`tokenmill bench quality` runs it (its corpus, windows of 1024, prompt chunks of 128), and fp8 at three fixed
scales: e4m3 is a float format, so a scale of 0.9 or 1.1 changes only which way values round, and the spread over
scales is what the figure's noise is.

  .venv/bin/python docs/benchmarks/2026-12-02-kv-offsets/offsets_ab.py [OUT.jsonl [KV_CACHE_DTYPE]]

"off" runs the same engine with each offset held at zero (the stored values are then those of the commit before).
"""

from __future__ import annotations

import gc
import json
import sys
import time

import tokenmill.layers.attention as attention
from tokenmill import LLM
from tokenmill.bench import quality

RUNS = [("auto", None, 1.0)] + [  # (kv_cache_dtype, offsets, scale; None: the engine's own)
    (dtype, offsets, scale) for dtype, scales in (("fp8", (1.0, 0.9, 1.1)), ("fp8_e5m2", (1.0, 0.9, 1.1)),
                                                  ("int8", (None,)))
    for scale in scales for offsets in (False, True)]

_add, _init = attention.KVCalibration.add, attention.PagedAttention.__init__


def configure(offsets: bool, scale: float | None) -> None:
    def add(self, k, v):
        _add(self, k, v)
        if not offsets:
            self.k_sum.zero_()

    def init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        if scale is not None:
            self.k_scale = self.v_scale = scale

    attention.KVCalibration.add, attention.PagedAttention.__init__ = add, init


def main() -> None:
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    only = sys.argv[2] if len(sys.argv) > 2 else None   # e.g. fp8_e5m2: only that dtype's runs
    for dtype, offsets, scale in RUNS:
        if only and dtype != only:
            continue
        configure(bool(offsets), scale)
        t0 = time.perf_counter()
        llm = LLM(kv_cache_dtype=dtype, kv_cache_memory="256MiB", max_num_batched_tokens=128)
        layer = llm.engine_core.executor.runner.model.attention_layers()[0]
        ppl = quality.perplexity(llm, quality.corpus_windows(llm.tokenizer, 1024))
        row = {"kv_cache_dtype": dtype, "offsets": offsets, "scale": scale, "perplexity": round(ppl, 4),
               "offset_absmax": None if layer.k_offset is None else round(float(layer.k_offset.abs().max()), 3),
               "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
