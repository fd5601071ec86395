# Start and stop the servers that the side-by-side scripts compare, and W2 through one of them. Sourced by a
# script that has set B (its results folder); ROOT (the checkout), PEERS (../shared/peers), TM (tokenmill's CLI),
# PY (the python that runs the peers' clients) and VLLM_ENV (vLLM bound to both cores) default to this layout's.
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PEERS=${PEERS:-$ROOT/../shared/peers}
TM=${TM:-$ROOT/.venv/bin/tokenmill}
PY=${PY:-/tmp/peers/vllmcpu/bin/python}
VLLM_ENV=${VLLM_ENV:-"VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"}
export HF_HUB_OFFLINE=1

# --no-repack on a CPU with AMX: this llama.cpp build's AMX matmul (ggml_backend_amx_mul_mat) dies of a general
# protection fault there at the first forward; without repacking it runs its AVX-512/VNNI vector path, as on CPUs
# without AMX. Elsewhere it runs as it is (its repacked Q4 layouts are its fastest path).
LLAMA_FLAGS=${LLAMA_FLAGS-$(grep -q amx_tile /proc/cpuinfo && echo --no-repack)}
llama_up() {  # slots, context per slot, label
  (cd $PEERS && NP=$1 CTX_PER_SLOT=$2 PORT=8080 ./serve_llamacpp.sh $LLAMA_FLAGS > $B/llamacpp_$3.log 2>&1) &
  until curl -sf localhost:8080/health > /dev/null; do sleep 0.3; done
}
llama_down() { pkill -TERM -f llama-server; sleep 2; }
tm_up() {  # label, tokenmill serve flags...
  local label=$1; shift
  $TM serve --port 8100 "$@" > $B/serve_$label.log 2>&1 &
  TMPID=$!
  until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done
}
tm_down() { kill -TERM $TMPID; wait $TMPID; }
w2() {  # port, label: one streamed request, 128 in / 256 out (serve_client.py; TTFT = first chunk)
  (cd $PEERS && PEERS_RESULTS=$B/w2_serve.jsonl $PY serve_client.py --port $1 --workload W2 --engine "$2" \
     > $B/w2_$2.log 2>&1)
}
