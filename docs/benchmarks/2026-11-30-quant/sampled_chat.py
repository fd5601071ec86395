"""Sampled real-text traffic, the same for tokenmill and vLLM (both have LLM.chat): the 16 chat prompts of
`tokenmill bench quality`, 8 times each (128 conversations, all at once), temperature 0.8, top-p 0.95, a seed per
request, up to 128 tokens with natural stops; then one conversation alone, 256 tokens (ignore_eos), for TPOT.

  .venv/bin/python sampled_chat.py --engine tokenmill [--quantization int4] [--kv-cache-dtype fp8]
  /tmp/peers/vllmcpu/bin/python sampled_chat.py --engine vllm --model /tmp/models/smollm2-135m-instruct
"""
import argparse
import json
import time
from pathlib import Path

# the chat prompts of `tokenmill bench quality`, read as a file: this script also runs in vLLM's environment
CHATS = json.loads((Path(__file__).resolve().parents[3] / "tokenmill/bench/data/chats.json").read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["tokenmill", "vllm"], required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--label", default=None)
    a = ap.parse_args()
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, seed=0)
    else:
        from tokenmill import LLM, SamplingParams
        llm = LLM(model=a.model, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
    convs = [[{"role": "user", "content": c}] for c in CHATS] * 8
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, seed=0)
    llm.chat(convs[:2], params, use_tqdm=False)  # warm-up
    per_req = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, seed=i) for i in range(len(convs))]
    t0 = time.perf_counter()
    try:
        outs = llm.chat(convs, per_req, use_tqdm=False)
    except (TypeError, ValueError):  # an engine that takes one SamplingParams for all
        outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    one = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, ignore_eos=True, seed=1)
    first = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=1, seed=1)
    ttft = min(_timed(llm, convs[0], first) for _ in range(3))
    total = min(_timed(llm, convs[0], one) for _ in range(3))
    print("RESULT " + json.dumps(dict(engine=a.label or a.engine, quantization=a.quantization,
                                      kv_cache_dtype=a.kv_cache_dtype, requests=len(convs), wall_s=round(wall, 2),
                                      output_tokens=out_tokens, output_tok_per_s=round(out_tokens / wall, 1),
                                      single_ttft_ms=round(ttft * 1e3, 1),
                                      single_tpot_ms=round((total - ttft) / 255 * 1e3, 2))))


def _timed(llm, conv, params):
    t0 = time.perf_counter()
    llm.chat([conv], params, use_tqdm=False)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
