#!/bin/bash
# The quantization figures of the closing note, back to back on this machine (both cores, one heavy job at a time):
# W2 single stream through each server with the same streaming client (tokenmill in each mode, llama.cpp's server on
# the same Q4_1 file), W2 offline, W1 and W5 offline for each mode, and vLLM's W2/W1 (bf16) for reference.
set -x
B=${B:-/tmp/bench/quant}; mkdir -p $B
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
PY=/tmp/peers/vllmcpu/bin/python
export HF_HUB_OFFLINE=1
VLLM_ENV="VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
cd $ROOT

serve_w2() {  # label, tokenmill flags...
  local label=$1; shift
  $TM serve --port 8100 "$@" > $B/serve_$label.log 2>&1 &
  local pid=$!
  until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done
  (cd $PEERS && PEERS_RESULTS=$B/w2_serve.jsonl $PY serve_client.py --port 8100 --workload W2 \
     --engine "tokenmill $label" > $B/w2_serve_$label.log 2>&1)
  kill -TERM $pid; wait $pid
}

# W2 through the servers, alternating tokenmill and llama.cpp
(cd $PEERS && NP=1 CTX_PER_SLOT=2048 PORT=8080 ./serve_llamacpp.sh > $B/llamacpp_w2.log 2>&1) &
until curl -sf localhost:8080/health > /dev/null; do sleep 0.3; done
(cd $PEERS && PEERS_RESULTS=$B/w2_serve.jsonl $PY serve_client.py --port 8080 --workload W2 \
   --engine "llama.cpp Q4_1" > $B/w2_serve_llamacpp1.log 2>&1)
pkill -TERM -f llama-server; sleep 2
serve_w2 bf16
serve_w2 int8 --quantization int8
serve_w2 int4 --quantization int4
serve_w2 gguf --quantization gguf
(cd $PEERS && NP=1 CTX_PER_SLOT=2048 PORT=8080 ./serve_llamacpp.sh > $B/llamacpp_w2b.log 2>&1) &
until curl -sf localhost:8080/health > /dev/null; do sleep 0.3; done
(cd $PEERS && PEERS_RESULTS=$B/w2_serve.jsonl $PY serve_client.py --port 8080 --workload W2 \
   --engine "llama.cpp Q4_1" > $B/w2_serve_llamacpp2.log 2>&1)
pkill -TERM -f llama-server; sleep 2

# W2 offline, each mode
for mode in bf16 int8 int4 gguf; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  $TM bench latency --workload W2 --num-iters 3 $flags --output-json $B/w2_$mode.json > $B/w2_$mode.log 2>&1
done

# W1 offline: bf16, the weight modes, the KV dtypes; vLLM bf16 in the middle
$TM bench throughput --workload W1 --disable-tqdm --output-json $B/w1_bf16.json > $B/w1_bf16.log 2>&1
$TM bench throughput --workload W1 --disable-tqdm --quantization int8 --output-json $B/w1_int8.json > $B/w1_int8.log 2>&1
$TM bench throughput --workload W1 --disable-tqdm --kv-cache-dtype fp8 --output-json $B/w1_kvfp8.json > $B/w1_kvfp8.log 2>&1
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl $PY vllm_offline.py --workloads W2,W1 \
   --dtype bfloat16 > $B/vllm.log 2>&1)
$TM bench throughput --workload W1 --disable-tqdm --quantization int4 --output-json $B/w1_int4.json > $B/w1_int4.log 2>&1
$TM bench throughput --workload W1 --disable-tqdm --quantization gguf --output-json $B/w1_gguf.json > $B/w1_gguf.log 2>&1
$TM bench throughput --workload W1 --disable-tqdm --output-json $B/w1_bf16b.json > $B/w1_bf16b.log 2>&1

# W5: one 256 MiB cache, prompts of 64..1,024 tokens
for kv in auto fp8 int8; do
  $TM bench throughput --workload W5 --disable-tqdm --kv-cache-dtype $kv --output-json $B/w5_$kv.json \
    > $B/w5_$kv.log 2>&1
done
echo DONE
