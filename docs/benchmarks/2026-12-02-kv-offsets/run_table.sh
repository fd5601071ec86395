#!/bin/bash
# Issue 11's tables on this host, one part after the other in one window: the quality table (every mode), W2 in
# each weight mode round-robin in one process, W2 through the servers back to back (llama.cpp's on the embedded
# model's own Q4_1 file, tokenmill gguf / int4 / int8 / bf16, llama.cpp again), W1 per mode (bf16 first and last),
# W5 with a bf16 and an fp8 cache, and vLLM's CPU build offline on W2 and W1.
#   B=/tmp/bench/i11 PARTS="quality modes servers w1 w5 vllm" docs/benchmarks/2026-12-02-kv-offsets/run_table.sh
set -x
B=${B:-/tmp/bench/i11}; mkdir -p $B
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
PY=/tmp/peers/vllmcpu/bin/python
PARTS=${PARTS:-"quality modes servers w1 w5 vllm"}
export HF_HUB_OFFLINE=1
cd $ROOT
if [[ $PARTS == *quality* ]]; then
  $TM bench quality --output-json $B/quality.json > $B/quality.txt 2>&1
fi
if [[ $PARTS == *modes* ]]; then
  .venv/bin/python docs/benchmarks/2026-12-01-stack/w2_modes.py rounds=5 > $B/w2_modes.txt 2>&1
fi
if [[ $PARTS == *servers* ]]; then
  source $ROOT/docs/benchmarks/servers.sh   # llama_up, llama_down, tm_up, tm_down, w2
  llama_up 1 2048 a; w2 8080 llamacpp-q4_1; llama_down
  for mode in gguf int4 int8 bf16; do
    flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
    tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
  done
  llama_up 1 2048 b; w2 8080 llamacpp-q4_1-b; llama_down
fi
if [[ $PARTS == *w1* ]]; then
  for run in bf16 int8 int4 gguf kvfp8 bf16b; do
    case $run in
      bf16|bf16b) flags="" ;; kvfp8) flags="--kv-cache-dtype fp8" ;; *) flags="--quantization $run" ;;
    esac
    $TM bench throughput --workload W1 $flags --output-json $B/w1_$run.json > $B/w1_$run.log 2>&1
  done
fi
if [[ $PARTS == *w5* ]]; then
  for kv in auto fp8; do
    $TM bench throughput --workload W5 --kv-cache-dtype $kv --output-json $B/w5_$kv.json > $B/w5_$kv.log 2>&1
  done
fi
if [[ $PARTS == *vllm* ]]; then
  (cd $PEERS && PEERS_RESULTS=$B/vllm_offline.jsonl VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
     VLLM_CPU_NUM_OF_RESERVED_CPU=0 $PY vllm_offline.py --workloads W2,W1 --dtype bfloat16 > $B/vllm.log 2>&1)
fi
echo TABLE DONE
