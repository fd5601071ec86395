#!/bin/bash
# The structured-output overhead figures of README.md: W4 (64 random 256-token prompts -> 128 tokens; Poisson 2 req/s
# and all at once) against one tokenmill server, unconstrained and with a JSON schema on every request, alternated
# so drift hits both; then vLLM's CPU build the same way. Run from a clone of the commit.
cd ${CLONE:-/tmp/benchclone}
export PYTHONPATH=${CLONE:-/tmp/benchclone} HF_HUB_OFFLINE=1
PY=/work/main/.venv/bin/python
OUT=${OUT:-/tmp/sores}; mkdir -p $OUT
# 20 objects cannot fit in 128 tokens, so every constrained answer runs to max_tokens like the --ignore-eos baseline.
SCHEMA='{"type":"object","required":["items"],"additionalProperties":false,"properties":{"items":{"type":"array","minItems":20,"items":{"type":"object","required":["name","description","price","in_stock"],"additionalProperties":false,"properties":{"name":{"type":"string"},"description":{"type":"string"},"price":{"type":"number","minimum":0},"in_stock":{"type":"boolean"}}}}}}'
bench() {  # url label rate extra...
  url=$1; label=$2; rate=$3; shift 3
  $PY -m tokenmill.cli.main bench serve --base-url $url --workload W4 --request-rate $rate "$@" \
    --output-json $OUT/$label.json > $OUT/$label.log 2>&1
}
$PY -m tokenmill.cli.main serve --port 8093 > $OUT/tokenmill.server.log 2>&1 &
pid=$!
for i in $(seq 120); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8093/health | grep -q 200 && break; sleep 1; done
# a warm-up pass of each mode first (the first run after start pays page faults, the grammar threads, a compile)
bench http://127.0.0.1:8093 warmup_none 8 --ignore-eos --num-prompts 16
bench http://127.0.0.1:8093 warmup_json 8 --num-prompts 16 --extra-body "{\"structured_outputs\": {\"json\": $SCHEMA}}"
rm -f $OUT/warmup_*.json
for rep in $(seq ${REPS:-2}); do
  for rate in 2 inf; do
    bench http://127.0.0.1:8093 tm_none_r${rate}_$rep $rate --ignore-eos
    bench http://127.0.0.1:8093 tm_json_r${rate}_$rep $rate --extra-body "{\"structured_outputs\": {\"json\": $SCHEMA}}"
  done
done
curl -s 127.0.0.1:8093/metrics | grep -E "^tokenmill:(generation_tokens_total|num_requests)" > $OUT/tokenmill.metrics
kill $pid; wait $pid 2>/dev/null
$PY docs/benchmarks/2026-11-30-structured/grammar_compile.py > $OUT/grammar_compile.log 2>&1
echo done > $OUT/DONE_TM
[ -n "$SKIP_VLLM" ] && exit 0
# vLLM's CPU build (xgrammar, its default backend), same workload and schema
VPY=/tmp/peers/vllmcpu/bin/python
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
$VPY -m vllm.entrypoints.openai.api_server --model /tmp/models/smollm2-135m-instruct-bf16 --dtype bfloat16 \
  --port 8094 --max-model-len 2048 > $OUT/vllm.server.log 2>&1 &
vpid=$!
for i in $(seq 300); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8094/health | grep -q 200 && break; sleep 1; done
for rate in 2 inf; do
  bench http://127.0.0.1:8094 vllm_none_r$rate $rate --ignore-eos
  bench http://127.0.0.1:8094 vllm_json_r$rate $rate --extra-body "{\"structured_outputs\": {\"json\": $SCHEMA}}"
done
kill $vpid; wait $vpid 2>/dev/null
echo done > $OUT/DONE
