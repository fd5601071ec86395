"""N streamed completions at once (64 prompt tokens, 128 output tokens each) against a server on port 8100, for
measuring the API process's CPU per streamed token: read its utime + stime (/proc/PID/stat fields 14-15) before
and after.   python streams_client.py [N=16]"""
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

N = int(sys.argv[1]) if len(sys.argv) > 1 else 16
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def one(i: int) -> int:
    body = json.dumps({"model": MODEL, "prompt": [(1000 + 11 * j + 7 * i) % 40000 for j in range(64)],
                       "max_tokens": 128, "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request("http://localhost:8100/v1/completions", body, {"Content-Type": "application/json"})
    n = 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            n += line.startswith(b"data: {")
    return n


t = time.perf_counter()
with ThreadPoolExecutor(N) as ex:
    total = sum(ex.map(one, range(N)))
print(total, "tokens", round(time.perf_counter() - t, 2), "s")
