#!/usr/bin/env bash
# W1 and W2 with TP=1, TP=2 and PP=2, back to back on one machine (2 cores: each rank of 2 gets one core).
# TP needs heads that 2 divides: the padded SmolLM2 copy (16 query / 4 KV heads, zero-weight extras) is made
# first; it does ~25% more attention-projection work than the original, so TP=1 runs on both.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/benchmarks/2026-11-30-parallel/results}
PADDED=${PADDED:-/tmp/smollm2-padded}
mkdir -p "$OUT"
[ -f "$PADDED/config.json" ] || $PY -m tokenmill.model.pad_heads "$PADDED"
# the same KV blocks for every layout (each rank holds its share of the heads and layers of each block)
COMMON="--dtype bfloat16 --num-gpu-blocks-override 3200 --disable-tqdm"
run() {  # name, workload, extra args
  local name=$1 wl=$2; shift 2
  if [ "$wl" = W1 ]; then
    $PY -m tokenmill.cli.main bench throughput --workload W1 $COMMON --profile --output-json "$OUT/${name}_w1.json" "$@" \
      > "$OUT/${name}_w1.txt" 2>&1
  else
    $PY -m tokenmill.cli.main bench latency --workload W2 --dtype bfloat16 --num-gpu-blocks-override 3200 --num-iters 3 \
      --output-json "$OUT/${name}_w2.json" "$@" > "$OUT/${name}_w2.txt" 2>&1
  fi
  echo "$name $wl done"
}
for wl in W1 W2; do
  run tp1_embedded $wl
  run tp1_padded $wl --model "$PADDED"
  run tp2_padded $wl --model "$PADDED" --tensor-parallel-size 2
  run pp2_embedded $wl --pipeline-parallel-size 2
  run pp2_padded $wl --model "$PADDED" --pipeline-parallel-size 2
done
