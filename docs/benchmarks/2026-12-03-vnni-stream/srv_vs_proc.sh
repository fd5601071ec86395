#!/bin/bash
# int4: W2 through the server vs in process, alternated
B=${B:-/tmp/bench/svp}; mkdir -p $B; rm -f $B/w2_serve.jsonl
source "$(dirname "$0")/../servers.sh"
cd $ROOT
for r in 1 2 3; do
  tm_up int4 --quantization int4; w2 8100 srv-int4-$r; w2 8100 srv2-int4-$r; tm_down
  .venv/bin/python - <<'PY' 2>&1 | grep -v INFO
import time
from tokenmill import LLM, SamplingParams
llm = LLM(quantization="int4", enable_prefix_caching=False)
p = [{"prompt_token_ids": [(1000 + 11 * j) % 40000 for j in range(128)]}]
def wall(n):
    t = time.perf_counter(); llm.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False); return time.perf_counter() - t
wall(8)
for _ in range(2):
    a, b = wall(1), wall(256)
    print("in-process int4 TPOT ms", round((b - a) / 255 * 1e3, 2))
PY
done
grep -o '"engine": "[^"]*"\|"tpot_ms": [0-9.]*' $B/w2_serve.jsonl | paste - -
