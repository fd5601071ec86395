"""End to end: a real `tokenmill serve` process and the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import time

import openai
import pytest
import requests
from server_utils import ServerProcess, kill_mid_stream

KEY = "test-key-123"


@pytest.fixture(scope="module")
def collector():
    """An OTLP/HTTP trace collector on 127.0.0.1: it keeps the bodies POSTed to /v1/traces."""
    import http.server
    import threading

    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces", bodies
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(collector):
    s = ServerProcess("--api-key", KEY, "--kv-cache-memory", "128MiB", "--dtype", "float32",
                      "--served-model-name", "smol", "--pooler", "mean", "--cost-per-hour", "3.6",
                      "--otlp-traces-endpoint", collector[0], env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _metric(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_completion_and_chat(client):
    c = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 12 and c.choices[0].text
    ch = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is 2+2?"}],
                                        max_tokens=30, temperature=0)
    assert "4" in ch.choices[0].message.content and ch.choices[0].message.role == "assistant"
    assert ch.usage.prompt_tokens > 5


def test_embeddings_with_the_openai_client(client, server):
    """/v1/embeddings beside generation on one server: a batch equals each input alone, token ids equal their text,
    base64 carries the same float32 values, and dimensions the model cannot give is a 400 naming the field."""
    import base64

    import numpy as np

    texts = ["The cat sat on the mat.", "A much longer sentence about the engine that computes embeddings " * 3]
    batch = client.embeddings.create(model="smol", input=texts)
    assert [d.index for d in batch.data] == [0, 1] and batch.usage.prompt_tokens > 20
    vecs = [np.array(d.embedding) for d in batch.data]
    assert all(len(v) == 576 and abs(np.linalg.norm(v) - 1) < 1e-4 for v in vecs)
    alone = np.array(client.embeddings.create(model="smol", input=texts[1]).data[0].embedding)
    assert float(alone @ vecs[1]) >= 0.9999 and float(vecs[0] @ vecs[1]) < 0.99
    ids = requests.post(server.url + "/tokenize", headers=_auth(), json={"model": "smol", "prompt": texts[0]}).json()
    by_ids = np.array(client.embeddings.create(model="smol", input=ids["tokens"]).data[0].embedding)
    assert float(by_ids @ vecs[0]) >= 0.9999
    raw = requests.post(server.url + "/v1/embeddings", headers=_auth(),
                        json={"model": "smol", "input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vecs[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="smol", input="x", dimensions=64)
    for body in ({"input": []}, {"input": [[]]}, {"input": [10**9]}, {"input": 5}, {}):   # 422: a body's wrong shape
        r = requests.post(server.url + "/v1/embeddings", headers=_auth(), json={"model": "smol", **body})
        assert r.status_code in (400, 422), (body, r.status_code, r.text)


def test_cost_per_request_in_usage_and_metrics(client, server):
    """--cost-per-hour 3.6 (a thousandth of a dollar a second): usage carries the request's engine seconds and their
    price, a request that asks for more work is charged more, streams carry it in their usage chunk, and /metrics
    counts every finished request's cost."""
    short = client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0).usage
    long = client.completions.create(model="smol", prompt="Hi " * 200, max_tokens=40, temperature=0).usage
    for u in (short, long):
        assert u.engine_seconds > 0 and u.cost_usd == pytest.approx(u.engine_seconds / 1000, rel=1e-3)
    assert long.engine_seconds > 3 * short.engine_seconds
    chunks = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.cost_usd > 0
    text = requests.get(server.url + "/metrics").text
    count = [line for line in text.splitlines() if line.startswith("tokenmill:request_cost_usd_count")]
    assert count and float(count[0].split()[-1]) >= 3


def test_streaming_with_usage_matches_non_streaming(client):
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    chat = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi!"}],
                                               max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].usage.completion_tokens >= 1


def test_n_logprobs_and_stop(client):
    c = client.completions.create(model="smol", prompt="Name a colour:", max_tokens=6, n=2, temperature=1.0,
                                  seed=5, logprobs=2)
    assert sorted(ch.index for ch in c.choices) == [0, 1]
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(len(t) >= 2 for t in lp.top_logprobs)
    ch = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count to five."}],
                                        max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    content = ch.choices[0].logprobs.content
    assert len(content) >= 1 and len(content[0].top_logprobs) == 3
    full = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0]
    stop = full.text[4:7]
    cut = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"


def test_16_concurrent_streams(client):
    prompts = [f"Story number {i}: once upon a time" for i in range(16)]
    expected = [client.completions.create(model="smol", prompt=p, max_tokens=10, temperature=0).choices[0].text
                for p in prompts[:4]]

    def stream(p):
        parts = [c.choices[0].text for c in client.completions.create(
            model="smol", prompt=p, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
            if c.choices]
        return "".join(parts)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, prompts))
    assert texts[:4] == expected and all(texts)


def test_disconnect_frees_blocks(server):
    body = {"model": "smol", "prompt": "Tell me a long story", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with requests.post(server.url + "/v1/completions", json=body, headers=_auth(), stream=True) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith(b"data:") for line in got)
        assert _metric(server, "tokenmill:kv_cache_usage_perc") > 0
    deadline = time.time() + 20
    while time.time() < deadline and _metric(server, "tokenmill:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    assert _metric(server, "tokenmill:kv_cache_usage_perc") == 0
    assert _metric(server, "tokenmill:num_requests_running") == 0


def test_non_streamed_request_is_aborted_when_its_client_goes(server):
    """The client gives up after a second; its request must stop within a few seconds, not run to 2,000 tokens."""
    body = {"model": "smol", "prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=1.0)
    deadline = time.time() + 10
    while time.time() < deadline and _metric(server, "tokenmill:num_requests_running") > 0:
        time.sleep(0.2)
    assert _metric(server, "tokenmill:num_requests_running") == 0
    assert _metric(server, "tokenmill:kv_cache_usage_perc") == 0


def test_auth(server):
    r = requests.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/metrics").status_code == 200
    models = requests.get(server.url + "/v1/models", headers=_auth()).json()
    assert models["data"][0]["id"] == "smol"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": ""}, None),
    ({"prompt": []}, None),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [99999999]}, None),
])
def test_bad_completion_inputs_get_400(server, body, param):
    r = requests.post(server.url + "/v1/completions", json=body, headers=_auth())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
    if param:
        assert err["param"] == param


def test_malformed_json_long_prompt_and_unknown_model(server):
    r = requests.post(server.url + "/v1/completions", data="{not json", headers={**_auth(),
                      "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    limit = requests.get(server.url + "/v1/models", headers=_auth()).json()["data"][0]["max_model_len"]
    r = requests.post(server.url + "/v1/completions", json={"prompt": [100] * (limit + 5), "max_tokens": 1},
                      headers=_auth())
    assert r.status_code == 400 and str(limit + 5) in r.json()["error"]["message"] and \
        str(limit) in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]}, headers=_auth())
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": []}, headers=_auth())
    assert r.status_code == 400


def test_metrics_tokenize_detokenize_version(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
    families = {f.name for f in text_string_to_metric_families(requests.get(server.url + "/metrics").text)}
    for name in ("tokenmill:num_requests_running", "tokenmill:kv_cache_usage_perc", "tokenmill:prompt_tokens",
                 "tokenmill:generation_tokens", "tokenmill:time_to_first_token_seconds",
                 "tokenmill:inter_token_latency_seconds", "tokenmill:e2e_request_latency_seconds",
                 "tokenmill:request_queue_time_seconds", "tokenmill:request_success", "tokenmill:num_preemptions",
                 "tokenmill:prefix_cache_queries", "tokenmill:prefix_cache_hits", "tokenmill:num_requests_waiting"):
        assert name in families, name
    assert _metric(server, "tokenmill:generation_tokens_total") >= 3
    tok = requests.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=_auth()).json()
    assert tok["count"] == len(tok["tokens"]) == 2
    text = requests.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=_auth()).json()
    assert text["prompt"] == "Hello world"
    assert json.loads(requests.get(server.url + "/version").text)["version"]


def test_engine_death_fails_health_and_exits():
    s = ServerProcess("--kv-cache-memory", "64MiB")
    try:
        codes, exit_code, errors = kill_mid_stream(s, s.engine_pid, max_tokens=2000)
        assert codes and codes[-1] != 200, "health kept answering 200 with the engine dead"
        assert exit_code != 0
        assert errors and errors[0]["code"] == 500, errors
    finally:
        s.stop()


def test_sigterm_drains_in_flight_requests():
    import signal

    s = ServerProcess("--kv-cache-memory", "64MiB")
    try:
        body = {"prompt": "Count slowly", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with requests.post(s.url + "/v1/completions", json=body, stream=True) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]"
        finishes = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in rest[:-1]
                    if x.startswith(b"data: {")]
        assert finishes[-1] == "length"
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_cache_salt_field(client):
    kw = dict(model="smol", prompt="Tenants do not share", max_tokens=2, temperature=0)
    assert client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kw).choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"cache_salt": ""})


def test_grafana_dashboard_names_only_exported_metrics(client, server):
    """docs/grafana-dashboard.json: every tokenmill:* series its panels query is one the server exports (after a
    request, so the histograms and counters have samples)."""
    import re
    from pathlib import Path

    client.completions.create(model="smol", prompt="Hi", max_tokens=2)
    exported = {line.split("{")[0].split(" ")[0] for line in requests.get(server.url + "/metrics").text.splitlines()
                if line.startswith("tokenmill:")}
    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"tokenmill:[a-z0-9_]+", e)}
    assert len(named) >= 15
    assert named <= exported, named - exported


def test_one_trace_span_per_request_reaches_the_collector(client, collector):
    """--otlp-traces-endpoint: a finished request arrives at the collector as an `llm_request` span whose times
    add up (queue + prefill + decode = end to end) and whose token counts are the response's."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    usage = client.completions.create(model="smol", prompt="Trace me", max_tokens=7, temperature=0,
                                      extra_body={"request_id": "traced-1"}).usage
    spans = {}
    deadline = time.time() + 20
    while "traced-1-0" not in spans and time.time() < deadline:
        time.sleep(0.2)
        for body in list(collector[1]):
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {a.key: a.value for a in span.attributes}
                        spans[attrs["gen_ai.request.id"].string_value] = (span, attrs)
    span, attrs = spans["traced-1-0"]
    assert span.name == "llm_request" and span.end_time_unix_nano > span.start_time_unix_nano
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"].int_value == usage.completion_tokens == 7
    lat = {k.split(".")[-1]: v.double_value for k, v in attrs.items() if k.startswith("gen_ai.latency.")}
    assert lat["time_in_queue"] + lat["time_in_model_prefill"] + lat["time_in_model_decode"] == \
        pytest.approx(lat["e2e"], abs=1e-6)
    assert 0 < lat["time_to_first_token"] <= lat["e2e"] == pytest.approx(
        (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9, abs=1e-3)


def test_engine_state_shows_requests_and_their_blocks(client, server):
    """GET /v1/engine/state while requests run: each shows its progress and the blocks it holds, and requests that
    share a prompt share its cached blocks; afterwards nothing runs and the prompt's blocks are free but cached.
    It needs the API key like the API."""
    assert requests.get(server.url + "/v1/engine/state").status_code == 401
    prompt = "The history of the paged KV cache, told at length: " * 12
    seen: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client.completions.create, model="smol", prompt=prompt, max_tokens=60,
                               temperature=0) for _ in range(3)]
        while not all(f.done() for f in futures):
            resp = requests.get(server.url + "/v1/engine/state", headers=_auth())
            if resp.status_code == 503:   # the engine answered after the state's 2 s (a slowed guest): poll again
                continue
            state = resp.json()
            seen += [state] if state["engines"][0]["requests"] else []
            time.sleep(0.05)
    assert seen, "never saw a running request"
    busiest = max(seen, key=lambda s: len(s["engines"][0]["requests"]))["engines"][0]
    running = [r for r in busiest["requests"] if r["status"] == "running"]
    assert running and all(r["blocks"] and r["num_computed_tokens"] > 0 for r in running)
    for r in running:   # its runs of blocks cover its tokens
        assert sum(n for _, n in r["blocks"]) * 16 >= r["num_computed_tokens"]
    if len(running) > 1:   # requests with the same prompt hold its full blocks together
        assert busiest["shared_blocks"]
    after = requests.get(server.url + "/v1/engine/state", headers=_auth()).json()
    engine = after["engines"][0]
    assert engine["requests"] == [] and sum(n for _, n in engine["cached_free_blocks"]) >= 10
    assert engine["num_blocks"] > 0 and engine["block_size"] == 16
    assert after["recent"]["requests_finished"] >= 3 and after["recent"]["ttft_s"]["p50"] > 0
    assert after["recent"]["cost_usd_per_million_output_tokens"] > 0   # --cost-per-hour is set


def test_the_built_in_page(server):
    """GET / serves the page from the package: open (it holds no data), nothing fetched from elsewhere, and every
    endpoint it calls exists and refuses a call without the API key."""
    import re

    page = requests.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)   # no CDN, no remote asset
    called = set(re.findall(r'fetch\("([^"]+)"', page.text))
    assert called == {"v1/models", "v1/chat/completions", "v1/engine/state"}
    for path in called:
        method = requests.post if "completions" in path else requests.get
        assert method(f"{server.url}/{path}", json={}).status_code == 401
        assert method(f"{server.url}/{path}", headers=_auth(),
                      json={"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_the_page_in_a_real_browser(server, tmp_path):
    """Headless Chromium (Debian's package, driven by playwright) opens /, enters the API key, chats and sees the
    streamed answer with its TTFT, then watches the engine view list running requests and colour their KV blocks
    while a batch runs. Screenshots of both views go to the test's tmp_path (and TOKENMILL_SCREENSHOTS, if set)."""
    import os
    import shutil

    chromium = shutil.which("chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("Debian's chromium package is not installed (make setup installs it where apt can)")
    out = os.environ.get("TOKENMILL_SCREENSHOTS") or str(tmp_path)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server.url + "/")
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "24")
        page.fill("#prompt", "What is 2+2?")
        page.click("#send")
        page.wait_for_selector(".msg + .stats", timeout=60000)
        assert page.inner_text(".msg.assistant").strip() and "TTFT" in page.inner_text(".stats")
        page.screenshot(path=f"{out}/page-chat.png")

        page.click("#tab-engine")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(requests.post, server.url + "/v1/completions", headers=_auth(),
                                   json={"model": "smol", "prompt": "Tell a long story " * 20, "max_tokens": 120,
                                         "ignore_eos": True}) for _ in range(4)]
            page.wait_for_function("document.querySelectorAll('#reqs tr').length > 0", timeout=60000)
            colored = page.eval_on_selector_all(
                "#grid div", "cells => cells.filter(c => c.style.background && "
                             "!c.style.background.includes('224, 224, 224')).length")
            page.wait_for_timeout(1500)   # a few refreshes: the charts draw the last minute
            page.screenshot(path=f"{out}/page-engine.png")
            assert all(f.result().status_code == 200 for f in futures)
        assert colored > 0
        charts = page.eval_on_selector_all("#charts polyline", "lines => lines.map(l => l.getAttribute('points'))")
        assert len(charts) == 5 and all(points.count(",") > 1 for points in charts)
        assert "USD / 1M output tokens" in page.inner_text("#cards")
        browser.close()


def test_beam_search_over_the_api_equals_offline(server, smol_llm):
    """vLLM's use_beam_search: completions give the offline LLM.beam_search beams in its order (best_of beams kept,
    n returned); chat returns n beams; what cannot combine with it is a 400 naming the field."""
    from tokenmill.beam_search import BeamSearchParams

    prompt = "The capital of France is"
    offline = smol_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))[0]
    body = {"model": "smol", "prompt": prompt, "max_tokens": 6, "n": 2, "best_of": 3, "use_beam_search": True}
    r = requests.post(server.url + "/v1/completions", json=body, headers=_auth())
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in offline.sequences[:2]]
    assert r.json()["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in offline.sequences[:2])
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "n": 2,
            "use_beam_search": True, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=chat, headers=_auth(), stream=True) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert len(texts) == 2 and texts[0] != texts[1]
    for bad, field in (({"temperature": 0.8}, "temperature"), ({"response_format": {"type": "json_object"}},
                                                                 "response_format")):
        r = requests.post(server.url + "/v1/chat/completions", json={**chat, "stream": False, **bad}, headers=_auth())
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
