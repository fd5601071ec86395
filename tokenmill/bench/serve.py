"""`tokenmill bench serve`: a streaming load generator for any OpenAI-compatible server (tokenmill, vLLM,
llama.cpp), with Poisson arrivals or all at once, reporting TTFT, TPOT, ITL and end-to-end latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from tokenmill.bench.datasets import apply_workload, random_requests
from tokenmill.bench.mm_dataset import encoder_summary, encoder_totals, image_contents, image_sizes
from tokenmill.bench.report import emit, percentiles


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0        # seconds from the run's start


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server, without the endpoint path.")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first /v1/models).")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=["W4"], default=None, help="W4 of shared/workloads.md.")
    p.add_argument("--dataset", choices=["random", "random-mm"], default="random",
                   help="random: token-id prompts; random-mm: image chats (generated images and a question, sent "
                        "to /v1/chat/completions), for vision models.")
    p.add_argument("--random-mm-images-per-request", type=int, default=1, help="random-mm: images per request.")
    p.add_argument("--random-mm-image-size", default="336x336",
                   help="random-mm: WxH of the images, or several comma-separated (image k takes size k mod N).")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None)
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="Distinct shared prefixes of --prefix-len tokens; request i gets prefix i mod N (a router's "
                        "prefix-affinity workload).")
    p.add_argument("--dataset-seed", type=int, default=None)
    p.add_argument("--request-rate", default="inf", help="Requests per second (Poisson arrivals), or inf.")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals; 1 is Poisson.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="Force every output to --output-len tokens.")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body, e.g. "
                   "'{\"response_format\": {...}}' to measure structured output.")
    p.add_argument("--tokenizer", default=None, help="Tokenizer for chat prompts (default: the embedded model's).")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--output-json", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds before one request counts as failed.")
    p.add_argument("--sweep-rates", default=None, help="Comma-separated rates to run one after another, e.g. "
                                                         "0.5,1,2,4,inf (the latency-throughput curve).")
    p.add_argument("--rate-schedule", default=None,
                   help="A load over time instead of one rate: SECONDS:RATE pairs, e.g. 20:0.5,30:6,60:0 (the "
                        "prompts are as many as arrive); against a router, its replica counts are sampled too.")
    p.add_argument("--plot", default=None, help="With --sweep-rates: draw TTFT and ITL p50/p99 against output "
                                                "tok/s into this PNG; with --rate-schedule: latency and replicas "
                                                "over time.")
    p.add_argument("--compare", action="append", help="Another sweep's --output-json to overlay on the plot.")
    p.add_argument("--label", default=None, help="This server's name in the sweep file and plot.")


def _payload(ns, model: str, prompt_ids: list[int], prompt_text: str | None, output_len: int) -> dict:
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ns.ignore_eos:
        body.update(ignore_eos=True, min_tokens=output_len)
    if ns.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt_text}]   # a string, or random-mm's content parts
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt_ids
    if ns.extra_body:
        body.update(json.loads(ns.extra_body))
    return body


async def _one(session, ns, url: str, headers: dict, body: dict, prompt_len: int) -> RequestResult:
    import aiohttp

    res = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=ns.timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                    res.prompt_len = msg["usage"].get("prompt_tokens") or res.prompt_len   # images' tokens too
                choices = msg.get("choices") or []
                text = ""
                if choices:
                    c = choices[0]
                    text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if not text:
                    continue
                t = time.perf_counter()
                if chunks == 0:
                    res.ttft = t - start
                else:
                    res.itl.append(t - last)
                last = t
                chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _first_model(session, base_url: str, headers: dict) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as resp:
        return (await resp.json())["data"][0]["id"]


async def _arrivals(n: int, rate: float, burstiness: float, seed: int, times: list[float] | None = None,
                    start: float = 0.0):
    if times is not None:   # a --rate-schedule: at its arrival times
        for i, t in enumerate(times[:n]):
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
            yield i
        return
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


def _prompts(ns) -> tuple[list, list]:
    """The requests' token ids, and for chat their message content: the ids' text, or random-mm's images and text."""
    apply_workload(ns)
    reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.prefix_len, ns.dataset_seed,
                           ns.vocab_size, num_prefixes=ns.num_prefixes)
    texts = [None] * len(reqs)
    if ns.dataset == "random-mm":
        ns.endpoint = "/v1/chat/completions"
    if ns.endpoint == "/v1/chat/completions":
        from tokenmill.model.source import resolve_model
        from tokenmill.model.tokenizer import load_tokenizer

        tok = load_tokenizer(ns.tokenizer or resolve_model(None).path)
        texts = [tok.decode(r.prompt_token_ids) for r in reqs]
    if ns.dataset == "random-mm":
        texts = image_contents(len(reqs), ns.random_mm_images_per_request, image_sizes(ns.random_mm_image_size),
                               texts, ns.dataset_seed or 0)
    return reqs, texts


async def _run(ns) -> dict:
    import aiohttp

    from tokenmill.bench.timeline import FleetPoller, parse_schedule, schedule_arrivals

    arrival_times = None
    if ns.rate_schedule:
        schedule = parse_schedule(ns.rate_schedule)
        arrival_times = schedule_arrivals(schedule, ns.dataset_seed or 0)
        ns.num_prompts = max(1, len(arrival_times))
    reqs, texts = _prompts(ns)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    rate = float(ns.request_rate)
    sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    url = ns.base_url.rstrip("/") + ns.endpoint
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = ns.model or await _first_model(session, ns.base_url.rstrip("/"), headers)

        async def limited(i: int) -> RequestResult:
            body = _payload(ns, model, reqs[i].prompt_token_ids, texts[i], reqs[i].output_len)
            t = time.perf_counter() - start
            if sem is None:
                res = await _one(session, ns, url, headers, body, len(reqs[i].prompt_token_ids))
            else:
                async with sem:
                    res = await _one(session, ns, url, headers, body, len(reqs[i].prompt_token_ids))
            res.start = t
            return res

        base = ns.base_url.rstrip("/")
        encoder_before = await encoder_totals(session, base, headers) if ns.dataset == "random-mm" else None
        start = time.perf_counter()
        poller = FleetPoller(session, ns.base_url.rstrip("/"), headers, start) if arrival_times is not None else None
        polling = asyncio.create_task(poller.run()) if poller else None
        tasks = []
        async for i in _arrivals(len(reqs), rate, ns.burstiness, ns.dataset_seed, arrival_times, start):
            tasks.append(asyncio.create_task(limited(i)))
        results = await asyncio.gather(*tasks)
        if poller:   # the schedule's quiet end: keep watching the fleet scale down
            await asyncio.sleep(max(0.0, sum(s for s, _ in schedule) - (time.perf_counter() - start)))
            polling.cancel()
        duration = time.perf_counter() - start
        encoder_after = await encoder_totals(session, base, headers) if encoder_before else None
    summary = _summarize(ns, model, rate, results, duration)
    ok = [r for r in results if r.success]
    summary.update(encoder_summary(encoder_before, encoder_after, len(ok),
                                   sum(r.ttft for r in ok) / len(ok) if ok else 0.0))
    if poller:
        summary.update(rate_schedule=ns.rate_schedule, timeline={
            "requests": [[r.start, r.ttft, r.latency, r.success] for r in results], "fleet": poller.samples})
    return summary


def _summarize(ns, model: str, rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = dict(base_url=ns.base_url, endpoint=ns.endpoint, model=model, request_rate=str(rate),
                   max_concurrency=ns.max_concurrency, num_prompts=len(results), successful_requests=len(ok),
                   failed_requests=len(results) - len(ok), duration_s=duration,
                   request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
                   total_token_throughput=(in_tokens + out_tokens) / duration, total_input_tokens=in_tokens,
                   total_output_tokens=out_tokens)
    summary.update(percentiles([r.ttft for r in ok], "ttft"))
    summary.update(percentiles(tpots, "tpot"))
    summary.update(percentiles([x for r in ok for x in r.itl], "itl"))
    summary.update(percentiles([r.latency for r in ok], "e2el"))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def run_serve_bench(ns: argparse.Namespace) -> int:
    if ns.sweep_rates:
        return _run_sweep(ns)
    summary = asyncio.run(_run(ns))
    emit(summary, "Serving benchmark", ns.output_json)
    if "timeline" in summary and ns.plot:
        from tokenmill.bench.plot import plot_timeline

        plot_timeline(summary["timeline"], ns.plot, ns.label or ns.base_url)
        print(f"plot saved to {ns.plot}")
    for e in summary.get("errors", []):
        print(f"error: {e}")
    return 0 if summary["failed_requests"] == 0 else 1


def _run_sweep(ns: argparse.Namespace) -> int:
    """One run per rate, the same prompts each time; saves all summaries and optionally the latency plot."""
    import copy

    summaries = []
    for rate in ns.sweep_rates.split(","):
        run_ns = copy.copy(ns)
        run_ns.request_rate = rate.strip()
        summary = asyncio.run(_run(run_ns))
        emit(summary, f"Serving benchmark, rate {rate}", None)
        summaries.append(summary)
    result = {"label": ns.label or ns.base_url, "runs": summaries}
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved to {ns.output_json}")
    if ns.plot:
        from tokenmill.bench.plot import plot_sweeps

        others = [json.load(open(path)) for path in (ns.compare or [])]
        plot_sweeps([result, *others], ns.plot)
        print(f"plot saved to {ns.plot}")
    return 0 if all(s["failed_requests"] == 0 for s in summaries) else 1
