#!/bin/bash
# W4 all at once (64 requests, 256 in / 128 out) through tokenmill's server without the prompt cap while decoding
# (--prefill-tokens-while-decoding 0, the old behaviour) and with the server's default (512), alternated, with
# vLLM's server between the rounds; one client (`tokenmill bench serve`) for all.
#   B=/tmp/bench/itl docs/benchmarks/2026-12-03-itl/run_w4_caps.sh
B=${B:-/tmp/bench/itl}; mkdir -p $B
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM; tm_up, tm_down
cd $ROOT
w4() {  # port, label
  $TM bench serve --base-url http://127.0.0.1:$1 --workload W4 --request-rate inf --ignore-eos --label "$2" \
    --output-json $B/$2.json > $B/$2.log 2>&1
}
tokenmill_round() {  # round number; the order alternates
  local caps="0 default"; [ $(( $1 % 2 )) = 0 ] && caps="default 0"
  for cap in $caps; do
    if [ $cap = default ]; then tm_up cap_default_$1; else tm_up cap0_$1 --prefill-tokens-while-decoding 0; fi
    w4 8100 tm_cap${cap}_$1; tm_down
  done
}
tokenmill_round 1
(cd $PEERS && PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1) &
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
w4 8000 vllm_1
pkill -TERM -f vllm_cli.py; sleep 5; pkill -KILL -f vllm_cli.py
tokenmill_round 2
for f in $B/*.log; do
  case $f in *serve*) continue;; esac
  echo "$(basename $f .log): $(grep -E '^(duration_s|p50_ttft_ms|p99_ttft_ms|p50_itl_ms|p99_itl_ms)' $f | tr -s ' ' | tr '\n' ' ')"
done
