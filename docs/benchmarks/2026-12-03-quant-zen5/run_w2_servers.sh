#!/bin/bash
# W2 (one streamed request, 128 in / 256 out) through llama.cpp's server on the embedded model's own Q4_1 file,
# then tokenmill's server in each weight mode, then llama.cpp again, one client (serve_client.py) for all.
#   B=/tmp/bench/w2s docs/benchmarks/2026-12-03-quant-zen5/run_w2_servers.sh
B=${B:-/tmp/bench/w2s}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM, PY; llama_up, llama_down, tm_up, tm_down, w2
cd $ROOT
llama_up 1 2048 first; w2 8080 llamacpp-q4_1-first; llama_down
for mode in bf16 int8 int4 gguf; do
  flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
  tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
done
llama_up 1 2048 last; w2 8080 llamacpp-q4_1-last; llama_down
cat $B/w2_serve.jsonl
