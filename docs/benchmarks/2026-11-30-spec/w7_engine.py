"""W7 (shared/workloads.md) for any engine with vLLM's offline API: the 12 chats that repeat Python code, one at a
time, greedy, max_tokens 256, natural stop; TPOT per request = (full time - 1-token time) / (tokens - 1), the mean
over requests with >= 32 output tokens. Runs speculation off and on in the same process when the engine allows
(`--compare`), else one configuration; prints one RESULT line with the token ids so runs can be compared.

  .venv/bin/python w7_engine.py --engine tokenmill --spec '{"method":"ngram","num_speculative_tokens":3}'
  /tmp/peers/vllmcpu/bin/python w7_engine.py --engine vllm --model /tmp/models/smollm2-135m-instruct-bf16 --spec ...
"""
import argparse
import json
import time
from pathlib import Path

CHATS = json.loads((Path(__file__).resolve().parents[3] / "tokenmill/bench/data/w7_chats.json").read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["tokenmill", "vllm"], required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--spec", default=None, help="speculative_config JSON (none: speculation off)")
    ap.add_argument("--label", default=None)
    a = ap.parse_args()
    spec = json.loads(a.spec) if a.spec else None
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, seed=0, enable_prefix_caching=False,
                  speculative_config=spec)
    else:
        from tokenmill import LLM, SamplingParams
        llm = LLM(model=a.model, dtype="bfloat16", kv_cache_memory="512MiB", enable_prefix_caching=False,
                  speculative_config=spec)
    full = SamplingParams(temperature=0.0, max_tokens=256)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.chat([CHATS[0]], full, use_tqdm=False)   # warm-up
    rows = []
    for chat in CHATS:
        ttft, _ = _timed(llm, chat, one)
        total, ids = _timed(llm, chat, full)
        rows.append(dict(tokens=len(ids), tpot_ms=(total - ttft) / max(len(ids) - 1, 1) * 1e3, ttft_ms=ttft * 1e3,
                         ids=ids))
    counted = [r for r in rows if r["tokens"] >= 32]
    tpot = sum(r["tpot_ms"] for r in counted) / len(counted)
    print("RESULT " + json.dumps(dict(engine=a.label or a.engine, spec=spec, tpot_ms=round(tpot, 2),
                                      counted=len(counted), per_request_tpot=[round(r["tpot_ms"], 2) for r in rows],
                                      token_ids=[r["ids"] for r in rows])))


def _timed(llm, chat, params):
    t0 = time.perf_counter()
    out = llm.chat([chat], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, list(out.outputs[0].token_ids)


if __name__ == "__main__":
    main()
