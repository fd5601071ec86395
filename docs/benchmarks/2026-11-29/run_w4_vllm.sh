#!/bin/bash
# W4 back to back: tokenmill's server, then vLLM's (bf16, both cores bound), the same client for both.
set -x
B=/tmp/bench
cd /work/main
export HF_HUB_OFFLINE=1
T0=$(date +%s.%N)
.venv/bin/tokenmill serve --port 8100 > $B/tm_serve.log 2>&1 &
TMPID=$!
until curl -sf localhost:8100/health > /dev/null; do sleep 0.2; done
echo "tokenmill startup: $(echo "$(date +%s.%N) - $T0" | bc) s" | tee $B/tm_startup.txt
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8100 --workload W4 --ignore-eos --sweep-rates 1,2,4,inf \
  --label tokenmill --output-json $B/tm_w4_sweep.json > $B/tm_w4.log 2>&1
kill -TERM $TMPID; wait $TMPID
cd /work/shared/peers
T0=$(date +%s.%N)
PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1 &
VPID=$!
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
echo "vllm startup: $(echo "$(date +%s.%N) - $T0" | bc) s" | tee $B/vllm_startup.txt
cd /work/main
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8000 --workload W4 --ignore-eos --sweep-rates 1,2,4,inf \
  --label "vLLM 0.32 CPU" --output-json $B/vllm_w4_sweep.json --plot $B/w4_sweep.png --compare $B/tm_w4_sweep.json \
  > $B/vllm_w4.log 2>&1
kill -TERM $VPID; wait $VPID; pkill -f vllm_cli.py
echo DONE
