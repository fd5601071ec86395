#!/bin/bash
# W1, W3 (prefix caching on) and W2 offline, tokenmill before and after vLLM's CPU build, one window.
#   B=/tmp/bench/cs docs/benchmarks/2026-12-03-cascade-stack/run_offline.sh
set -x
B=${B:-/tmp/bench/cs}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM, PY, VLLM_ENV
cd $ROOT
for run in a b; do
  [ $run = b ] && (cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl $PY vllm_offline.py \
    --workloads W2,W1,W3 --dtype bfloat16 > $B/vllm.log 2>&1)
  $TM bench throughput --workload W3 --disable-tqdm --output-json $B/tm_w3_$run.json > $B/tm_w3_$run.log 2>&1
  $TM bench throughput --workload W1 --disable-tqdm --output-json $B/tm_w1_$run.json > $B/tm_w1_$run.log 2>&1
  $TM bench latency --workload W2 --num-iters 3 --output-json $B/tm_w2_$run.json > $B/tm_w2_$run.log 2>&1
done
echo DONE
