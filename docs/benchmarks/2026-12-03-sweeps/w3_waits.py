"""Where each of the two threads waits in W3 (prefix caching on): one warm W3 run under `perf record` with DWARF
call graphs, then each sample of the engine's thread and of the OpenMP worker labelled by the op it is in (or
waits at the end of); a worker sample in libgomp is put against what the engine thread was doing within 3 ms.

    python docs/benchmarks/2026-12-03-sweeps/w3_waits.py OUT_DIR
"""
import bisect
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "shared/peers"))
from common import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
llm = LLM(enable_prefix_caching=True)
prompts, n = make_prompts("W3")
sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
assert llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
data = out / "w3.perf"
perf = subprocess.Popen(["perf", "record", "-F", "499", "--call-graph", "dwarf,16384", "-o", str(data), "-p",
                         str(os.getpid())], stderr=subprocess.DEVNULL)
time.sleep(1.0)
t = time.perf_counter()
llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
print(f"W3 warm, under perf: {time.perf_counter() - t:.2f} s")
perf.send_signal(signal.SIGINT)
perf.wait()
text = subprocess.run(["perf", "script", "-i", str(data), "-F", "tid,time,ip,sym,dso"], capture_output=True,
                      text=True).stdout

samples, cur = [], None
for line in text.splitlines():
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = None
    elif not line[0].isspace():
        head = line.split()
        cur = (head[0], float(head[1].rstrip(":")), [])
    elif cur is not None:
        parts = line.strip().split(" ", 1)
        cur[2].append(parts[1] if len(parts) > 1 else "")
if cur:
    samples.append(cur)


def label(frames: list[str]) -> str:
    top = frames[0] if frames else "?"
    op = next((f.split("tokenmill_native::")[1].split("(")[0] for f in frames if "tokenmill_native::" in f), None)
    if "libgomp" in top:
        return f"waits at the end of {op}" if op else "waits in libgomp"
    if op:
        return f"in {op}"
    if any("tokenmill_cpu_kernels" in f for f in frames):
        return "in other native code (lm head, argmax)"
    return "in Python and the rest"


tids = collections.Counter(s[0] for s in samples)
engine, worker = sorted(tids, key=int)[:2]
main = sorted((t, label(f)) for tid, t, f in samples if tid == engine)
times = [t for t, _ in main]
mine = collections.Counter(lbl for _, lbl in main)
waits = collections.Counter()
for tid, t, frames in samples:
    if tid == worker and frames and "libgomp" in frames[0]:
        i = bisect.bisect_left(times, t)
        near = [main[j] for j in (i - 1, i) if 0 <= j < len(main) and abs(main[j][0] - t) < 0.003]
        waits[near[0][1] if near else "no engine sample near"] += 1
lines = [f"engine thread, {len(main)} samples:"]
lines += [f"  {100 * c / len(main):5.1f}%  {k}" for k, c in mine.most_common(12)]
lines += [f"worker thread waiting in libgomp, share of its {tids[worker]} samples, by what the engine thread did:"]
lines += [f"  {100 * c / tids[worker]:5.1f}%  {k}" for k, c in waits.most_common(12)]
(out / "w3_waits.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
