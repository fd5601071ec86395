#!/bin/bash
# W2 (one streamed request, 128 in / 256 out) through the servers: llama.cpp on the embedded Q4_1 file, tokenmill
# (bf16, and gguf: the same Q4_1 blocks), llama.cpp again.
#   B=/tmp/bench/w2s docs/benchmarks/2026-12-03-cascade-stack/run_w2_servers.sh
set -x
B=${B:-/tmp/bench/w2s}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM, PY; llama_up, llama_down, tm_up, tm_down, w2
cd $ROOT
llama_up 1 2048 w2a; w2 8080 llamacpp-q4_1; llama_down
for mode in bf16 gguf; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
done
llama_up 1 2048 w2b; w2 8080 llamacpp-q4_1-b; llama_down
echo W2 DONE
