#!/usr/bin/env bash
# W1 (128 requests x 256 in / 128 out, all at once) in bf16 and each quantized weight mode, alternated ROUNDS
# times so the modes share the machine's speed of the moment. Results: results/w1_<mode>_<round>.json.
#   ROUNDS=2 MODES="bf16 int8" docs/benchmarks/2026-12-01-quant-amx/run_w1.sh
set -euo pipefail
cd "$(dirname "$0")"
out=results
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for mode in ${MODES:-bf16 int8 int4 gguf}; do
    args=()
    [ "$mode" != bf16 ] && args=(--quantization "$mode")
    echo "== $(date +%H:%M:%S) W1 $mode round $round"
    tokenmill bench throughput --workload W1 --disable-tqdm "${args[@]}" --output-json "$out/w1_${mode}_${round}.json" \
      2>&1 | grep -E "Throughput|wall|Wall|elapsed" || true
  done
done
