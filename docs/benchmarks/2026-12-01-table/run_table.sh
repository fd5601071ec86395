#!/bin/bash
# The side-by-side table of issue 16 (and the W2 quantization rows of issue 11) in one window on this machine:
# llama.cpp's server (the Q4_1 file the embedded model is) against tokenmill's server on W2 and on W8-1/W8, then
# every W1-W4 figure against vLLM's CPU build (../2026-11-30/run_all.sh, W4 at 2 req/s and all at once).
#   B=/tmp/bench/table docs/benchmarks/2026-12-01-table/run_table.sh
set -x
B=${B:-/tmp/bench/table}; mkdir -p $B
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
PY=/tmp/peers/vllmcpu/bin/python
export HF_HUB_OFFLINE=1
cd $ROOT

source $ROOT/docs/benchmarks/servers.sh   # llama_up, llama_down, tm_up, tm_down, w2
w8() {  # port, label: W8-1 (1 request) and W8 (4 at once), 7,936 random tokens in, 128 out, one client for all
  for n in 1 4; do
    $TM bench serve --base-url http://127.0.0.1:$1 --num-prompts $n --input-len 7936 --output-len 128 \
      --request-rate inf --ignore-eos --label "$2" --output-json $B/w8_n${n}_$2.json > $B/w8_n${n}_$2.log 2>&1
  done
}

# W2: llama.cpp, tokenmill in each weight mode, llama.cpp again
llama_up 1 2048 w2; w2 8080 llamacpp-q4_1; llama_down
for mode in bf16 gguf int4 int8; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
done
llama_up 1 2048 w2b; w2 8080 llamacpp-q4_1-b; llama_down

# W8-1 / W8: llama.cpp (4 slots of 8,192), tokenmill bf16 and gguf
llama_up 4 8192 w8; w8 8080 llamacpp-q4_1; llama_down
tm_up w8-bf16; w8 8100 tokenmill-bf16; tm_down
tm_up w8-gguf --quantization gguf; w8 8100 tokenmill-gguf; tm_down

# W1-W4 against vLLM
B=$B/vs_vllm RATES=2,inf $ROOT/docs/benchmarks/2026-11-30/run_all.sh
echo TABLE DONE
