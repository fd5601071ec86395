#!/bin/bash
# W2 in each weight mode after this stop's kernels: (1) the modes round-robin in one process against bf16
# (../2026-12-01-stack/w2_modes.py), the old checkout's kernels in the same window (run_ab.sh's worktree);
# (2) W2 through the servers back to back: llama.cpp's (the embedded model's own Q4_1 file), tokenmill gguf, int4,
# bf16, llama.cpp again.
#   OLD=aae00cd B=/tmp/bench/prefetch docs/benchmarks/2026-12-01-prefetch/run_w2.sh
set -x
B=${B:-/tmp/bench/prefetch}; mkdir -p $B
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
PY=/tmp/peers/vllmcpu/bin/python
OLD=${OLD:-aae00cd}
OLD_TREE=${OLD_TREE:-/tmp/tokenmill-$OLD}
OLD_CACHE=${OLD_CACHE:-/tmp/cache-$OLD}
PARTS=${PARTS:-"modes servers"}
export HF_HUB_OFFLINE=1
cd $ROOT
MODES=$ROOT/docs/benchmarks/2026-12-01-stack/w2_modes.py
if [[ $PARTS == *modes* ]]; then
  [ -d $OLD_TREE ] || git worktree add -f $OLD_TREE $OLD
  .venv/bin/python $MODES rounds=5 results=$B/w2_modes.jsonl > $B/w2_modes.log 2>&1
  (cd $OLD_TREE && XDG_CACHE_HOME=$OLD_CACHE PYTHONPATH=$OLD_TREE $ROOT/.venv/bin/python $MODES rounds=5 \
    results=$B/w2_modes_old.jsonl > $B/w2_modes_old.log 2>&1)
  .venv/bin/python $MODES rounds=5 results=$B/w2_modes.jsonl > $B/w2_modes2.log 2>&1
fi
if [[ $PARTS == *servers* ]]; then
  source $ROOT/docs/benchmarks/servers.sh   # llama_up, llama_down, tm_up, tm_down, w2
  llama_up 1 2048 a; w2 8080 llamacpp-q4_1; llama_down
  for mode in gguf int4 bf16; do
    flags=""; [ $mode != bf16 ] && flags="--quantization $mode"
    tm_up $mode $flags; w2 8100 tokenmill-$mode; tm_down
  done
  llama_up 1 2048 b; w2 8080 llamacpp-q4_1-b; llama_down
fi
echo W2 DONE
