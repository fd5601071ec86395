#!/bin/bash
# This stop's kernels against the last stop's, alternated in one window: the self-draft (issue 12) on W2 and W7
# (`tokenmill bench spec`, speculation off against on in one engine), and the 120 linears of a decode step
# (matmuls.py). The old checkout is a git worktree with its own kernel build (XDG_CACHE_HOME).
#   OLD=aae00cd B=/tmp/bench/prefetch docs/benchmarks/2026-12-01-prefetch/run_ab.sh
# (PARTS="spec" or "matmuls" runs one part; OLD_TREE and OLD_CACHE name an existing old checkout and build.)
set -x
B=${B:-/tmp/bench/prefetch}; mkdir -p $B
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
OLD=${OLD:-aae00cd}
OLD_TREE=${OLD_TREE:-/tmp/tokenmill-$OLD}
OLD_CACHE=${OLD_CACHE:-/tmp/cache-$OLD}
PARTS=${PARTS:-"spec matmuls"}
[ -d $OLD_TREE ] || git -C $ROOT worktree add -f $OLD_TREE $OLD
PY=$ROOT/.venv/bin/python
export HF_HUB_OFFLINE=1
I4='{"method":"draft_model","quantization":"int4","num_speculative_tokens":3}'
in_tree() {  # old|new, then the command's arguments
  local which=$1; shift
  if [ $which = old ]; then
    (cd $OLD_TREE && XDG_CACHE_HOME=$OLD_CACHE PYTHONPATH=$OLD_TREE $PY "$@")
  else
    (cd $ROOT && $PY "$@")
  fi
}
for r in 1 2; do
  [[ $PARTS == *spec* ]] || break
  for which in old new; do
    in_tree $which -m tokenmill.cli.main bench spec --workload W2 --num-iters 3 --speculative-config "$I4" \
      --output-json $B/spec_${which}_W2_$r.json > $B/spec_${which}_W2_$r.log 2>&1
  done
  for which in old new; do
    in_tree $which -m tokenmill.cli.main bench spec --workload W7 --speculative-config "$I4" \
      --output-json $B/spec_${which}_W7_$r.json > $B/spec_${which}_W7_$r.log 2>&1
  done
done
for r in 1 2 3; do
  [[ $PARTS == *matmuls* ]] || break
  for which in old new; do in_tree $which $HERE/matmuls.py $which >> $B/matmuls.jsonl; done
done
echo AB DONE
