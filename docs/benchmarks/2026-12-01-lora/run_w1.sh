#!/bin/sh
# W1 (128 requests, 256 in / 128 out, bf16) on the base model alone and with every request on one of eight
# rank-16 adapters (make_adapters.py), alternated, ROUNDS times. Results: one JSON line per run in OUT.
set -e
LORAS=${LORAS:-/tmp/smol-loras}
OUT=${OUT:-docs/benchmarks/2026-12-01-lora/w1.jsonl}
ROUNDS=${ROUNDS:-2}
for i in $(seq "$ROUNDS"); do
  for mode in base lora; do
    extra=""
    if [ "$mode" = lora ]; then
      extra="--enable-lora --max-loras 8 --max-lora-rank 16 --lora-path $(ls -d "$LORAS"/lora-* | tr '\n' ' ')"
    fi
    # shellcheck disable=SC2086
    .venv/bin/python -m tokenmill.cli.main bench throughput --workload W1 --dtype bfloat16 --disable-tqdm \
      --output-json /tmp/w1-$mode.json $extra > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open('/tmp/w1-$mode.json')); d['mode']='$mode'; print(json.dumps(d))" >> "$OUT"
  done
done
