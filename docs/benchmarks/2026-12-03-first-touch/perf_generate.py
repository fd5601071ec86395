"""perf samples of one workload's generate() only (not the start): attaches `perf record` to this process after
the engine is built, then `perf report -i /tmp/WORKLOAD.perf --no-children --sort symbol` shows where it went.

    python perf_generate.py W3
"""
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.environ.get("PEERS_DIR", "/work/shared/peers"))
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

workload = sys.argv[1]
llm = LLM(enable_prefix_caching=workload == "W3")
prompts, n = make_prompts(workload)
perf = subprocess.Popen(["perf", "record", "-q", "-o", f"/tmp/{workload}.perf", "-p", str(os.getpid())])
time.sleep(1)
t = time.perf_counter()
llm.generate([{"prompt_token_ids": p} for p in prompts],
             SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True), use_tqdm=False)
print(f"{workload} wall {time.perf_counter() - t:.2f} s")
perf.send_signal(signal.SIGINT)
perf.wait()
