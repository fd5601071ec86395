#!/bin/bash
# W4 all at once and W2 through a fresh tokenmill server: OLD (a worktree of a commit before the idle pre-fault,
# e.g. `git worktree add /tmp/wt_old 720ec4d`) against this checkout, alternated three rounds.
#   OLD=/tmp/wt_old B=/tmp/bench/prefault docs/benchmarks/2026-12-03-itl/prefault_ab.sh
B=${B:-/tmp/bench/prefault}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, TM; w2
OLD=${OLD:-/tmp/wt_old}
cd $ROOT
run() {  # label, checkout
  (cd $2 && PYTHONPATH=$2 $ROOT/.venv/bin/python -m tokenmill.cli.main serve --port 8100 > $B/serve_$1.log 2>&1) &
  until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done
  $TM bench serve --base-url http://127.0.0.1:8100 --workload W4 --request-rate inf --ignore-eos --label $1 \
    --output-json $B/$1.json > $B/$1.log 2>&1
  w2 8100 $1
  pkill -TERM -f "tokenmill.cli.main serve"; sleep 3
  echo "$1: $(grep -E '^(duration_s|p99_ttft_ms|p50_itl_ms|p99_itl_ms)' $B/$1.log | tr -s ' ' | tr '\n' ' ') W2: $(tail -1 $B/w2_serve.jsonl | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["ttft_ms"], r["tpot_ms"])')"
}
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then run before_$r $OLD; run after_$r $ROOT
  else run after_$r $ROOT; run before_$r $OLD; fi
done
