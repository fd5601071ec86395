#!/usr/bin/env bash
# Realistic chat traffic with vLLM's own client against tokenmill's server and vLLM's, one after the other:
# streamed chat completions of make_chats.py's conversations, temperature 0.7, Poisson arrivals.
#   run_chat.sh OUT_DIR [RATES] [NUM_PROMPTS] [ENGINES]      (defaults: "2 4", 100, "tokenmill vllm")
# TM_ARGS adds flags to `tokenmill serve` (TM_LABEL names that run's files, default "tokenmill").
set -euo pipefail
out=${1:-/tmp/chat}; rates=${2:-"2 4"}; n=${3:-100}; engines=" ${4:-tokenmill vllm} "
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
peers=${PEERS_DIR:-$root/../shared/peers}
mkdir -p "$out"
"$root/.venv/bin/python" "$here/make_chats.py" "$out/chats.json"
export HF_HUB_OFFLINE=1

wait_up() {  # port
  for _ in $(seq 600); do curl -sf "127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1
}
bench() {  # port label model
  for rate in $rates; do
    /tmp/peers/vllmcpu/bin/python "$peers/vllm_cli.py" bench serve --backend openai-chat \
      --endpoint /v1/chat/completions --host 127.0.0.1 --port "$1" --model "$3" \
      --tokenizer /tmp/models/smollm2-135m-instruct --dataset-name sharegpt --dataset-path "$out/chats.json" \
      --num-prompts "$n" --num-warmups 8 --request-rate "$rate" --temperature 0.7 --ignore-eos --seed 0 \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --result-dir "$out" \
      --result-filename "chat_$2_rate$rate.json" --disable-tqdm 2>&1 | sed -n "/Serving Benchmark Result/,/^=====*$/p"
  done
}

if [[ $engines == *" tokenmill "* ]]; then
# shellcheck disable=SC2086
"$root/.venv/bin/tokenmill" serve --port 8001 ${TM_ARGS:-} >"$out/${TM_LABEL:-tokenmill}_server.log" 2>&1 &
pid=$!
wait_up 8001
model=$(curl -s 127.0.0.1:8001/v1/models | "$root/.venv/bin/python" -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
bench 8001 "${TM_LABEL:-tokenmill}" "$model"
kill "$pid"; wait "$pid" || true
fi

if [[ $engines == *" vllm "* ]]; then
PORT=8000 "$peers/serve_vllm.sh" >"$out/vllm_server.log" 2>&1 &
pid=$!
wait_up 8000
bench 8000 vllm /tmp/models/smollm2-135m-instruct
kill "$pid"; wait "$pid" || true
fi
