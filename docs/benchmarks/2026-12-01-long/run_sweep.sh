#!/usr/bin/env bash
# Both sweeps, tokenmill then vLLM, then the two plots.   run_sweep.sh OUT_DIR
set -euo pipefail
out=${1:-/tmp/sweep}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
"$root/.venv/bin/python" "$here/sweep.py" --engine tokenmill 2>"$out/tm.log" | tee "$out/sweep_tokenmill.jsonl"
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  /tmp/peers/vllmcpu/bin/python "$here/sweep.py" --engine vllm 2>"$out/vllm.log" | grep --line-buffered '^{' \
  | tee "$out/sweep_vllm.jsonl"
"$root/.venv/bin/python" "$here/plot_sweep.py" "$out/sweep_tokenmill.jsonl" "$out/sweep_vllm.jsonl" "$out"
