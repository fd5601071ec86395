#!/bin/bash
# W4 (64 requests, 256 in / 128 out) all at once and at 2 req/s, tokenmill's server then vLLM's, one client
# (`tokenmill bench serve`) for both.   B=/tmp/bench/w4 docs/benchmarks/2026-12-03-prefill/run_w4.sh
B=${B:-/tmp/bench/w4}; mkdir -p $B; cd "$(dirname "$0")/../../.."; TM=.venv/bin/tokenmill; export HF_HUB_OFFLINE=1
$TM serve --port 8100 > $B/tm_serve.log 2>&1 &
P=$!; until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done
for rate in inf 2; do
  $TM bench serve --base-url http://127.0.0.1:8100 --workload W4 --request-rate $rate --ignore-eos --label tokenmill --output-json $B/tm_w4_$rate.json > $B/tm_w4_$rate.log 2>&1
done
kill -TERM $P; wait $P
T0=$(date +%s)
(cd ../shared/peers && PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1) &
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
echo "vllm ready in $(( $(date +%s) - T0 )) s"
for rate in inf 2; do
  $TM bench serve --base-url http://127.0.0.1:8000 --workload W4 --request-rate $rate --ignore-eos --label "vLLM 0.32 CPU" --output-json $B/vllm_w4_$rate.json > $B/vllm_w4_$rate.log 2>&1
done
pkill -TERM -f vllm_cli.py; sleep 5; pkill -KILL -f vllm_cli.py
echo W4 DONE
