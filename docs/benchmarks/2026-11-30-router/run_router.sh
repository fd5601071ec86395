#!/usr/bin/env bash
# The router over 2 replicas (one core each, started by `tokenmill router --replicas 2`), prefix affinity on
# against load alone, and one replica on both cores as the baseline. Two workloads, 16 requests in flight:
#   few:  64 requests, 8 distinct 1,024-token prefixes (request i gets prefix i mod 8), 32-token suffixes,
#         32 output tokens; every prefix fits in every replica's KV cache.
#   many: 128 requests, 16 such prefixes, 16 output tokens, 300 MiB of KV cache a replica (~12 prefixes): load
#         alone makes each replica cycle through all 16 (an LRU cache then never hits); affinity gives each
#         replica its share, which fits. The one-replica baseline gets both replicas' memory (600 MiB).
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/benchmarks/2026-11-30-router/results}
mkdir -p "$OUT"
FEW="--num-prompts 64 --prefix-len 1024 --num-prefixes 8 --input-len 32 --output-len 32"
MANY="--num-prompts 128 --prefix-len 1024 --num-prefixes 16 --input-len 32 --output-len 16"
COMMON="--ignore-eos --max-concurrency 16"
SERVE="--dtype bfloat16 --max-num-seqs 16"
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
hits() {  # prefix-cache hit tokens / queried tokens over the replicas
  for p in "$@"; do curl -s "http://127.0.0.1:$p/metrics"; done |
    awk '/^tokenmill:prefix_cache_hits_total/{h+=$2} /^tokenmill:prefix_cache_queries_total/{q+=$2} END{printf "%.0f %.0f\n", h, q}'
}
bench() {  # name, url, workload flags..., then the replica ports after --
  local name=$1 url=$2; shift 2
  local wl=() ports=()
  while [ "$1" != "--" ]; do wl+=("$1"); shift; done; shift; ports=("$@")
  $PY -m tokenmill.cli.main bench serve --base-url "$url" ${wl[@]} $COMMON --output-json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  echo "prefix-cache hit/query tokens: $(hits "${ports[@]}")" >> "$OUT/$name.txt"
  echo "$name done"
}
one_replica() {  # name, kv memory, workload
  local name=$1 mem=$2 wl=$3
  $PY -m tokenmill.cli.main serve $SERVE --kv-cache-memory "$mem" --port 8100 > "$OUT/${name}_server.log" 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8100
  bench "$name" http://127.0.0.1:8100 $wl -- 8100
  kill -INT $pid; wait $pid || true
}
routed() {  # name, affinity blocks, kv memory a replica, workload
  local name=$1 blocks=$2 mem=$3 wl=$4
  $PY -m tokenmill.cli.main router --replicas 2 --replica-args "$SERVE --kv-cache-memory $mem" --port 8000 \
    --affinity-blocks "$blocks" > "$OUT/${name}_router.log" 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8100 && wait_up http://127.0.0.1:8101 && wait_up http://127.0.0.1:8000
  bench "$name" http://127.0.0.1:8000 $wl -- 8100 8101
  kill -INT $pid; wait $pid || true
}
one_replica few_one_replica 1GiB "$FEW"
routed few_affinity 4 1GiB "$FEW"
routed few_load_only 0 1GiB "$FEW"
one_replica many_one_replica 600MiB "$MANY"
routed many_affinity 4 300MiB "$MANY"
routed many_load_only 0 300MiB "$MANY"
