#!/usr/bin/env bash
# Disaggregated prefill/decode against the same two instances as plain replicas, on a prompt-heavy mix:
# 48 requests of 1,024 random prompt tokens and 64 output tokens, Poisson arrivals at 1 req/s (W4's shape,
# longer prompts). Two `tokenmill serve` instances, one core each (--cpu-bind 0 / 1), both with
# --kv-transfer-config kv_both, restarted for each run (no cache carried over):
#   plain:  `tokenmill router --backend A --backend B` (prefix affinity, load aware): each replica prefills and
#           decodes, so its decode steps carry 1,024-token prompt chunks;
#   disagg: `tokenmill router --prefill A --decode B`: A computes every prompt, B pulls the blocks and decodes.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/benchmarks/2026-12-01-disagg/results}
mkdir -p "$OUT"
WL="--num-prompts 48 --input-len 1024 --output-len 64 --request-rate 1 --ignore-eos --dataset-seed 7"
SERVE="--dtype bfloat16 --kv-cache-memory 1GiB --max-num-seqs 32"
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
instance() {  # port, kv port, cpu
  $PY -m tokenmill.cli.main serve $SERVE --port "$1" --cpu-bind "$3" \
    --kv-transfer-config "{\"kv_connector\": \"ZmqConnector\", \"kv_role\": \"kv_both\", \"kv_port\": $2}" \
    > "$OUT/instance_$1.log" 2>&1 &
}
run() {  # name, router flags...
  local name=$1; shift
  instance 8101 15101 0; local a=$!
  instance 8102 15102 1; local b=$!
  wait_up http://127.0.0.1:8101 && wait_up http://127.0.0.1:8102
  $PY -m tokenmill.cli.main router --port 8000 "$@" > "$OUT/${name}_router.log" 2>&1 &
  local r=$!
  wait_up http://127.0.0.1:8000
  sleep 2   # every instance in rotation
  $PY -m tokenmill.cli.main bench serve --base-url http://127.0.0.1:8000 $WL --output-json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  curl -s http://127.0.0.1:8000/metrics | grep -E '^tokenmill_router:(requests|prefill)' >> "$OUT/$name.txt" || true
  kill -INT $r $a $b; wait $r $a $b || true
  echo "$name done"
}
run plain --backend http://127.0.0.1:8101 --backend http://127.0.0.1:8102
run disagg --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102
