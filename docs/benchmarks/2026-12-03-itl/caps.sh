#!/bin/bash
# W4 all at once through tokenmill's server at several --prefill-tokens-while-decoding values, alternated round by
# round (0 = no cap, the behaviour before it).   B=/tmp/bench/caps ROUNDS=3 docs/benchmarks/2026-12-03-itl/caps.sh
B=${B:-/tmp/bench/caps}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, TM; tm_up, tm_down
cd $ROOT
for round in $(seq ${ROUNDS:-3}); do
  for cap in 0 512 1024 256; do
    tm_up cap$cap --prefill-tokens-while-decoding $cap
    $TM bench serve --base-url http://127.0.0.1:8100 --workload W4 --request-rate inf --ignore-eos --label cap$cap \
      --output-json $B/cap${cap}_$round.json > $B/cap${cap}_$round.log 2>&1
    tm_down
    echo "cap $cap r$round: $(grep -E '^(duration_s|p99_ttft_ms|p50_itl_ms|p99_itl_ms)' $B/cap${cap}_$round.log | tr -s ' ' | tr '\n' ' ')"
  done
done
