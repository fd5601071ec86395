#!/bin/bash
# Issue 16's side-by-side table on this host, one window: W1-W3 offline against vLLM's CPU build (both cores
# bound), W8-1/W8 offline against vLLM, W2 and W8-1 through the servers against llama.cpp's on the embedded Q4_1
# file. (W4 through both servers: run_w4.sh beside it.)
#   B=/tmp/bench/t16 docs/benchmarks/2026-12-03-prefill/run_table.sh
set -x
B=${B:-/tmp/bench/t16}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM, PY, VLLM_ENV; llama_up, llama_down, tm_up, tm_down, w2
cd $ROOT

# W1-W3 offline: tokenmill, vLLM, tokenmill again
$TM bench throughput --workload W1 --disable-tqdm --profile --output-json $B/tm_w1.json > $B/tm_w1.log 2>&1
$TM bench throughput --workload W3 --disable-tqdm --output-json $B/tm_w3_on.json > $B/tm_w3_on.log 2>&1
$TM bench throughput --workload W3 --disable-tqdm --no-enable-prefix-caching --output-json $B/tm_w3_off.json \
  > $B/tm_w3_off.log 2>&1
$TM bench latency --workload W2 --num-iters 3 --output-json $B/tm_w2.json > $B/tm_w2.log 2>&1
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl $PY vllm_offline.py \
  --workloads W2,W1,W3 --dtype bfloat16 > $B/vllm_on.log 2>&1)
(cd $PEERS && env $VLLM_ENV PEERS_RESULTS=$B/vllm_offline.jsonl $PY vllm_offline.py \
  --workloads W3 --no-prefix-caching --dtype bfloat16 > $B/vllm_off.log 2>&1)
$TM bench throughput --workload W1 --disable-tqdm --output-json $B/tm_w1_b.json > $B/tm_w1_b.log 2>&1

# W8-1 and W8 offline, tokenmill then vLLM
docs/benchmarks/2026-12-01-long/run_pair.sh w8_offline.py $B/w8 --iters 1

# W2 and W8-1 through the servers: llama.cpp, tokenmill (bf16, gguf), llama.cpp again
llama_up 1 8192 w2; w2 8080 llamacpp-q4_1
$TM bench serve --base-url http://127.0.0.1:8080 --num-prompts 1 --input-len 7936 --output-len 128 --request-rate inf \
  --ignore-eos --label llamacpp-q4_1 --output-json $B/w8_1_llamacpp.json > $B/w8_1_llamacpp.log 2>&1
llama_down
for mode in bf16 gguf; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  tm_up $mode $flags; w2 8100 tokenmill-$mode
  $TM bench serve --base-url http://127.0.0.1:8100 --num-prompts 1 --input-len 7936 --output-len 128 \
    --request-rate inf --ignore-eos --label tokenmill-$mode --output-json $B/w8_1_tokenmill-$mode.json \
    > $B/w8_1_tokenmill-$mode.log 2>&1
  tm_down
done
llama_up 1 2048 w2b; w2 8080 llamacpp-q4_1-b; llama_down
echo TABLE DONE
