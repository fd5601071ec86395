#!/usr/bin/env bash
# One of this folder's offline scripts for tokenmill, then for vLLM's CPU build (both cores bound), back to back.
#   run_pair.sh SCRIPT OUT_DIR [ARGS...]    e.g. run_pair.sh w8_offline.py /tmp/w8
#                                                 run_pair.sh sweep.py /tmp/sweep && python plot_sweep.py /tmp/sweep/*.jsonl /tmp/sweep
set -euo pipefail
script=$1; out=$2; shift 2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
name=$(basename "$script" .py)
"$root/.venv/bin/python" "$here/$script" --engine tokenmill "$@" 2>"$out/tm.log" | tee "$out/${name}_tokenmill.jsonl"
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  /tmp/peers/vllmcpu/bin/python "$here/$script" --engine vllm "$@" 2>"$out/vllm.log" | grep --line-buffered '^{' \
  | tee "$out/${name}_vllm.jsonl"
