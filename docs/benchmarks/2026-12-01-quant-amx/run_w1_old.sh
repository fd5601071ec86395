#!/usr/bin/env bash
# W1 with int8 weights on the last stop's kernels (a worktree of OLD with its own kernel build) and on this
# checkout's, bf16 beside them, alternated twice. Results: results/w1_old_<label>_<round>.json.
#   OLD=3d980c0 docs/benchmarks/2026-12-01-quant-amx/run_w1_old.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
OLD=${OLD:-3d980c0}
OLD_TREE=${OLD_TREE:-/tmp/old_tm}
[ -d "$OLD_TREE" ] || git -C "$ROOT" worktree add -f "$OLD_TREE" "$OLD"
w1() {  # label, python path, cache dir, flags...
  local label=$1 path=$2 cache=$3; shift 3
  echo "== $(date +%H:%M:%S) W1 $label"
  (cd "$path" && XDG_CACHE_HOME=$cache PYTHONPATH=$path "$ROOT/.venv/bin/python" -m tokenmill.cli.main bench \
    throughput --workload W1 --disable-tqdm "$@" --output-json "$HERE/results/w1_old_${label}.json" 2>&1 \
    | grep elapsed_time)
}
for round in 1 2; do
  w1 "bf16_new_$round" "$ROOT" "${XDG_CACHE_HOME:-$HOME/.cache}"
  w1 "int8_old_$round" "$OLD_TREE" /tmp/oldcache --quantization int8
  w1 "int8_new_$round" "$ROOT" "${XDG_CACHE_HOME:-$HOME/.cache}" --quantization int8
done
