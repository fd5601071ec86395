#!/bin/bash
set -x
B=/tmp/bench/final2; mkdir -p $B
cd /work/main
TM=.venv/bin/tokenmill
export HF_HUB_OFFLINE=1
$TM bench throughput --workload W1 --disable-tqdm --profile --output-json $B/tm_w1.json > $B/tm_w1.log 2>&1
cd /work/shared/peers
PEERS_RESULTS=$B/peers.jsonl VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  /tmp/peers/vllmcpu/bin/python vllm_offline.py --workloads W2,W1,W3 --dtype bfloat16 > $B/vllm_on.log 2>&1
cd /work/main
$TM bench throughput --workload W3 --disable-tqdm --output-json $B/tm_w3_on.json > $B/tm_w3_on.log 2>&1
$TM bench throughput --workload W3 --disable-tqdm --no-enable-prefix-caching --output-json $B/tm_w3_off.json > $B/tm_w3_off.log 2>&1
$TM bench latency --workload W2 --num-iters 3 --output-json $B/tm_w2.json > $B/tm_w2.log 2>&1
echo DONE
#!/bin/bash
set -x
B=/tmp/bench/final2
cd /work/main
export HF_HUB_OFFLINE=1
T0=$(date +%s.%N)
.venv/bin/tokenmill serve --port 8100 > $B/tm_serve.log 2>&1 &
TMPID=$!
until curl -sf localhost:8100/health > /dev/null; do sleep 0.2; done
echo "tokenmill startup: $(echo "$(date +%s.%N) - $T0" | bc) s" | tee $B/tm_startup.txt
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8100 --workload W4 --ignore-eos --sweep-rates 1,2,4,inf --label tokenmill \
  --output-json $B/tm_w4_sweep.json --plot $B/w4_sweep.png --compare /tmp/bench/vllm_w4_sweep.json > $B/tm_w4.log 2>&1
kill -TERM $TMPID; wait $TMPID; echo "serve exit code $?"
echo DONE
