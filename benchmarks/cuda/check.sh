#!/usr/bin/env bash
# The CUDA check, on a bare GPU machine with torch and transformers but not this project's other packages (the
# device tool's H200). From the repo root, with two ignored folders made on a machine that has them (benchmarks/cuda/README.md):
#   .whl         wheels of the packages the GPU machine lacks
#   .cuda_carry  SmolLM2's tokenizer and config (the embedded GGUF is too large to carry)
# It runs tests/test_cuda.py, the CPU suite's tiny-model tests of the draft model, EAGLE, LoRA and embeddings
# (which run on the GPU there), then W1 and W2 on a random-weight model of SmolLM2-135M's shape, tokenmill and
# transformers side by side. Everything it writes lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TOKENMILL_TEST_TOKENIZER=$PWD/.cuda_carry/tokenizer
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"

PARTS=${PARTS:-"tests suite bench"}   # and "server": its test alone, with its log
if [[ $PARTS == *tests* ]]; then
    timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py 2>&1 \
        | tee "$OUT/test_cuda.log" | tail -40
fi
if [[ $PARTS == *server* ]]; then   # the server test alone, with the server's own log in the report
    TOKENMILL_TEST_LOG=1 timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py -k server \
        2>&1 | tee "$OUT/server.log" | tail -60
fi
if [[ $PARTS == *suite* ]]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_engine.py tests/test_lora.py \
        tests/test_embeddings.py -k "draft_checkpoint or eagle_heads or each_adapter or mixed_batch or never_share \
        or equals_transformers_pooling" 2>&1 | tee "$OUT/suite_on_gpu.log" | tail -25
fi
if [[ $PARTS == *bench* ]]; then
    MODEL=/tmp/smol-random
    python3 - "$MODEL" <<'PY'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
cfg = AutoConfig.from_pretrained(".cuda_carry/smol-config")
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(".cuda_carry/tokenizer").save_pretrained(sys.argv[1])
PY
    TM="python3 -m tokenmill.cli.main bench"
    timeout 150 $TM throughput --workload W1 --model $MODEL --kv-cache-memory 4GiB --disable-tqdm \
        --output-json "$OUT/w1.json" 2>&1 | tail -6
    timeout 120 $TM latency --workload W2 --model $MODEL --kv-cache-memory 1GiB --num-iters 2 \
        --output-json "$OUT/w2.json" 2>&1 | tail -8
    # the same W2 without CUDA graphs (eager forward, Triton attention): what the graphs are worth
    timeout 120 $TM latency --workload W2 --model $MODEL --kv-cache-memory 1GiB --num-iters 2 --enforce-eager \
        --output-json "$OUT/w2_eager.json" 2>&1 | tail -8
    for w in ${PROFILE:-W1 W2}; do   # where a step's time goes (the forward's kernels run on while the host moves on)
        timeout 150 $TM throughput --workload $w --model $MODEL --kv-cache-memory 4GiB --disable-tqdm --profile \
            2>&1 | tail -14
    done
    if [[ ${HF:-1} == 1 ]]; then
        timeout 150 python3 benchmarks/cuda/hf_baseline.py "$MODEL" 2>&1 | tee "$OUT/hf.txt"
    fi
fi
