#!/bin/bash
# Every figure of the closing note, back to back on this machine (bf16, both cores, one heavy job at a time):
# tokenmill and vLLM alternate per workload, and W4 uses the same client (`tokenmill bench serve`) for both servers.
set -x
B=${B:-/tmp/bench/final3}; mkdir -p $B
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
export HF_HUB_OFFLINE=1
VLLM_ENV="VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
cd $ROOT
$TM bench throughput --workload W1 --disable-tqdm --profile --output-json $B/tm_w1.json > $B/tm_w1.log 2>&1
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl /tmp/peers/vllmcpu/bin/python vllm_offline.py \
  --workloads W2,W1,W3 --dtype bfloat16 > $B/vllm_on.log 2>&1)
$TM bench throughput --workload W3 --disable-tqdm --output-json $B/tm_w3_on.json > $B/tm_w3_on.log 2>&1
$TM bench throughput --workload W3 --disable-tqdm --no-enable-prefix-caching --output-json $B/tm_w3_off.json \
  > $B/tm_w3_off.log 2>&1
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl /tmp/peers/vllmcpu/bin/python vllm_offline.py \
  --workloads W3 --no-prefix-caching --dtype bfloat16 > $B/vllm_off.log 2>&1)
$TM bench latency --workload W2 --num-iters 3 --output-json $B/tm_w2.json > $B/tm_w2.log 2>&1

RATES=${RATES:-0.5,1,2,4,inf}
T0=$(date +%s.%N)
$TM serve --port 8100 > $B/tm_serve.log 2>&1 &
TMPID=$!
until curl -sf localhost:8100/health > /dev/null; do sleep 0.2; done
echo "tokenmill startup: $(echo "$(date +%s.%N) - $T0" | bc) s" | tee $B/tm_startup.txt
$TM bench serve --base-url http://127.0.0.1:8100 --workload W4 --ignore-eos --sweep-rates $RATES --label tokenmill \
  --output-json $B/tm_w4_sweep.json > $B/tm_w4.log 2>&1
kill -TERM $TMPID; wait $TMPID; echo "tokenmill serve exit code $?"
T0=$(date +%s.%N)
(cd $PEERS && PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1) &
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
echo "vllm startup: $(echo "$(date +%s.%N) - $T0" | bc) s" | tee $B/vllm_startup.txt
$TM bench serve --base-url http://127.0.0.1:8000 --workload W4 --ignore-eos --sweep-rates $RATES \
  --label "vLLM 0.32 CPU" --output-json $B/vllm_w4_sweep.json > $B/vllm_w4.log 2>&1
pkill -TERM -f vllm_cli.py; sleep 5; pkill -KILL -f vllm_cli.py
.venv/bin/python -c "import json, sys; from tokenmill.bench.plot import plot_sweeps; plot_sweeps([json.load(open(p)) for p in sys.argv[2:]], sys.argv[1])" $B/w4_sweep.png $B/tm_w4_sweep.json $B/vllm_w4_sweep.json
echo DONE
