#!/bin/bash
# W4 (64 requests, 256 in / 128 out) all at once and at 2 req/s, tokenmill's server then vLLM's, one client
# (`tokenmill bench serve`) for both.   B=/tmp/bench/w4 [SETTLE=15] docs/benchmarks/2026-12-03-prefill/run_w4.sh
# Each server idles SETTLE seconds after it answers /health, as a server does before its traffic: vLLM writes its
# whole KV cache before it is ready, tokenmill's first writes its pages while idle (SETTLE=0: right after ready).
B=${B:-/tmp/bench/w4}; mkdir -p $B
SETTLE=${SETTLE:-15}
source "$(dirname "$0")/../servers.sh"   # ROOT, PEERS, TM; tm_up, tm_down
cd $ROOT
w4() {  # port, label, file prefix
  for rate in inf 2; do
    $TM bench serve --base-url http://127.0.0.1:$1 --workload W4 --request-rate $rate --ignore-eos --label "$2" \
      --output-json $B/$3_w4_$rate.json > $B/$3_w4_$rate.log 2>&1
  done
}
tm_up w4; sleep $SETTLE; w4 8100 tokenmill tm; tm_down
T0=$(date +%s)
(cd $PEERS && PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1) &
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
echo "vllm ready in $(( $(date +%s) - T0 )) s"
sleep $SETTLE
w4 8000 "vLLM 0.32 CPU" vllm
pkill -TERM -f vllm_cli.py; sleep 5; pkill -KILL -f vllm_cli.py
echo W4 DONE
