"""W7 against any OpenAI-compatible server (llama.cpp's, tokenmill's): the 12 chats one at a time, greedy,
max_tokens 256, natural stop, non-streamed; TPOT = (full time - 1-token time) / (completion tokens - 1), the mean
over requests with >= 32 tokens, as in w7_engine.py. Prints one RESULT line with the answers' text.

  python w7_server.py --port 8080 --label llamacpp-f16-ngram
"""
import argparse
import json
import time
from pathlib import Path

import requests

CHATS = json.loads((Path(__file__).resolve().parents[3] / "tokenmill/bench/data/w7_chats.json").read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--label", required=True)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}/v1/chat/completions"

    def call(chat, max_tokens):
        t0 = time.perf_counter()
        r = requests.post(url, json=dict(model=a.model, messages=chat, max_tokens=max_tokens, temperature=0.0,
                                         seed=0), timeout=600)
        r.raise_for_status()
        body = r.json()
        return time.perf_counter() - t0, body["usage"]["completion_tokens"], body["choices"][0]["message"]["content"]

    call(CHATS[0], 256)   # warm-up
    rows = []
    for chat in CHATS:
        ttft = min(call(chat, 1)[0] for _ in range(2))
        total, n, text = call(chat, 256)
        rows.append(dict(tokens=n, tpot_ms=(total - ttft) / max(n - 1, 1) * 1e3, text=text))
    counted = [r for r in rows if r["tokens"] >= 32]
    print("RESULT " + json.dumps(dict(engine=a.label, tpot_ms=round(sum(r["tpot_ms"] for r in counted) / len(counted), 2),
                                      counted=len(counted), per_request_tpot=[round(r["tpot_ms"], 2) for r in rows],
                                      tokens=[r["tokens"] for r in rows], texts=[r["text"] for r in rows])))


if __name__ == "__main__":
    main()
