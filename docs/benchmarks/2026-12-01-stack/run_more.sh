#!/bin/bash
# After run_stack.sh, in the same window: the self-draft (issue 12) on W7 and W2, speculation off against on in
# one engine (`tokenmill bench spec`), now that each draft pass is one native call; then W1 with int8 weights and
# with an fp8 KV cache next to bf16 (issue 11).
#   B=/tmp/bench/stack docs/benchmarks/2026-12-01-stack/run_more.sh
set -x
B=${B:-/tmp/bench/stack}; mkdir -p $B
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
TM=$ROOT/.venv/bin/tokenmill
export HF_HUB_OFFLINE=1
cd $ROOT
I4='{"method":"draft_model","quantization":"int4","num_speculative_tokens":3}'
GG='{"method":"draft_model","quantization":"gguf","num_speculative_tokens":3}'
$TM bench spec --workload W7 --speculative-config "$I4" --output-json $B/spec_w7_int4.json > $B/spec_w7_int4.log 2>&1
$TM bench spec --workload W2 --num-iters 3 --speculative-config "$I4" --output-json $B/spec_w2_int4.json \
  > $B/spec_w2_int4.log 2>&1
$TM bench spec --workload W7 --speculative-config "$GG" --output-json $B/spec_w7_gguf.json > $B/spec_w7_gguf.log 2>&1
$TM bench spec --workload W2 --num-iters 3 --speculative-config "$GG" --output-json $B/spec_w2_gguf.json \
  > $B/spec_w2_gguf.log 2>&1
for run in bf16 int8 fp8kv bf16b; do
  flags=""
  [ $run = int8 ] && flags="--quantization int8"
  [ $run = fp8kv ] && flags="--kv-cache-dtype fp8"
  $TM bench throughput --workload W1 --disable-tqdm $flags --output-json $B/w1_$run.json > $B/w1_$run.log 2>&1
done
echo MORE DONE
