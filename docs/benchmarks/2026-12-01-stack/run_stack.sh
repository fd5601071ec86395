#!/bin/bash
# The native decoder stack measured in one window: (1) off against on in one engine, alternated, at several batch
# sizes and weight modes; (2) W2 through each server: llama.cpp's (the embedded model's own Q4_1 file), tokenmill in
# each weight mode, tokenmill bf16 with --enforce-eager (no stack), llama.cpp again; (3) W1 offline: tokenmill,
# tokenmill --enforce-eager, vLLM's CPU build (with its W2), tokenmill again.
#   B=/tmp/bench/stack docs/benchmarks/2026-12-01-stack/run_stack.sh
set -x
B=${B:-/tmp/bench/stack}; mkdir -p $B
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
PY=/tmp/peers/vllmcpu/bin/python
export HF_HUB_OFFLINE=1
VLLM_ENV="VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
cd $ROOT

# (1) off / on in one engine
for b in 1 8 32 128; do
  out=128; [ $b -ge 32 ] && out=64
  .venv/bin/python $HERE/ab_stack.py batch=$b out=$out results=$B/ab.jsonl > $B/ab_b$b.log 2>&1
done
for q in gguf int4 int8; do
  .venv/bin/python $HERE/ab_stack.py batch=1 quantization=$q results=$B/ab.jsonl > $B/ab_$q.log 2>&1
done

# (2) W2 through the servers (serve_client.py, TTFT = first chunk)
source $ROOT/docs/benchmarks/servers.sh   # llama_up, llama_down, tm_up, tm_down, w2
llama_up 1 2048 a; w2 8080 llamacpp-q4_1; llama_down
tm_up bf16-eager --enforce-eager; w2 8100 tokenmill-bf16-eager; tm_down
for mode in bf16 gguf int4 int8; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
done
tm_up gguf-eager --quantization gguf --enforce-eager; w2 8100 tokenmill-gguf-eager; tm_down
llama_up 1 2048 b; w2 8080 llamacpp-q4_1-b; llama_down

# (3) W1 offline against vLLM
$TM bench throughput --workload W1 --disable-tqdm --profile --output-json $B/tm_w1.json > $B/tm_w1.log 2>&1
$TM bench throughput --workload W1 --disable-tqdm --profile --enforce-eager --output-json $B/tm_w1_eager.json \
  > $B/tm_w1_eager.log 2>&1
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl $PY vllm_offline.py --workloads W2,W1 \
  --dtype bfloat16 > $B/vllm.log 2>&1)
$TM bench throughput --workload W1 --disable-tqdm --profile --output-json $B/tm_w1_b.json > $B/tm_w1_b.log 2>&1
$TM bench latency --workload W2 --num-iters 3 --output-json $B/tm_w2.json > $B/tm_w2.log 2>&1
echo STACK DONE
