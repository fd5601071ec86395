#!/bin/bash
# W4 at one rate, tokenmill, vLLM, tokenmill again (the second tokenmill run brackets the host's drift), with the
# same client (`tokenmill bench serve`) against both servers.   B=/tmp/bench/w4 RATE=2 run_w4_pair.sh
set -x
B=${B:-/tmp/bench/w4}; RATE=${RATE:-2}; mkdir -p $B
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=$ROOT/../shared/peers
TM=$ROOT/.venv/bin/tokenmill
export HF_HUB_OFFLINE=1
w4() {  # port, label
  $TM bench serve --base-url http://127.0.0.1:$1 --workload W4 --ignore-eos --request-rate $RATE --label "$2" \
    --output-json $B/w4_$2.json > $B/w4_$2.log 2>&1
}
tokenmill() {  # label
  $TM serve --port 8100 > $B/serve_$1.log 2>&1 &
  local pid=$!
  until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done
  w4 8100 $1
  kill -TERM $pid; wait $pid
}
tokenmill tokenmill-1
(cd $PEERS && PORT=8000 ./serve_vllm.sh > $B/vllm_serve.log 2>&1) &
until curl -sf localhost:8000/health > /dev/null; do sleep 0.5; done
w4 8000 vllm
pkill -TERM -f vllm_cli.py; sleep 5; pkill -KILL -f vllm_cli.py
tokenmill tokenmill-2
echo W4 DONE
