#!/usr/bin/env bash
# Sampled real-text traffic (../2026-11-30-quant/sampled_chat.py: 128 chat conversations at once, temperature 0.8,
# top-p 0.95; then one alone for TPOT): tokenmill bf16 and int8 weights, vLLM's CPU build (bf16) between them,
# then tokenmill again. RESULT lines in results/sampled.log.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
S=$ROOT/docs/benchmarks/2026-11-30-quant/sampled_chat.py
TM=$ROOT/.venv/bin/python
VLLM=${VLLM:-/tmp/peers/vllmcpu/bin/python}
MODEL=${MODEL:-/tmp/models/smollm2-135m-instruct}
for round in 1 2; do
  $TM $S --engine tokenmill --label "tokenmill-bf16-$round" 2>&1 | grep RESULT
  $TM $S --engine tokenmill --quantization int8 --label "tokenmill-int8-$round" 2>&1 | grep RESULT
  # vLLM on both cores, as ../shared/peers/serve_vllm.sh runs it
  [ "$round" = 1 ] && HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VLLM $S --engine vllm --model "$MODEL" --label vllm-bf16 2>&1 | grep RESULT
done
