#!/usr/bin/env bash
# W8 and W8-1 back to back: tokenmill, then vLLM's CPU build (both cores bound), the same prompts and method.
# Usage: run_w8.sh OUT_DIR   (from the repository root's venv; vLLM from ../shared/peers/setup.sh)
set -euo pipefail
out=${1:-/tmp/w8}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
"$root/.venv/bin/python" "$here/w8_offline.py" --engine tokenmill 2>"$out/tm.log" | tee "$out/tm.jsonl"
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  /tmp/peers/vllmcpu/bin/python "$here/w8_offline.py" --engine vllm 2>"$out/vllm.log" | grep '^{' | tee "$out/vllm.jsonl"
