"""Fuzzing the HTTP surface: schemathesis generates requests from the server's own OpenAPI schema (every
operation), plus malformed JSON, wrong types, huge numbers, odd unicode and prompts of every length; the server
answers each with a status below 500 and in time. `make fuzz` runs the same with many more cases."""

from __future__ import annotations

import os

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("TOKENMILL_FUZZ_CASES", "40"))   # `make fuzz`: 1,000


@pytest.fixture(scope="module")
def server():
    # a short context keeps every generated case short (chat's default max_tokens is the rest of the context)
    s = ServerProcess("--dtype", "bfloat16", "--kv-cache-memory", "64MiB", "--max-model-len", "96",
                      "--max-num-seqs", "16")
    yield s
    s.stop()


def test_schemathesis_finds_no_server_error(server):
    import schemathesis

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    tried = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            nonlocal tried
            tried += 1
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

        check()
    print(f"schemathesis: {tried} cases")
    assert requests.get(server.url + "/health").status_code == 200


HUGE = 10**40


@pytest.mark.parametrize("body", [
    b"{", b"[]", b"null", b'{"prompt": "hi", "max_tokens": "many"}', b'{"prompt": 12}',
    b'{"prompt": "hi", "seed": 100000000000000000000000000000}', b'{"prompt": "hi", "priority": 1e400}',
    b'{"prompt": "hi", "top_k": 100000000000000000000000}', b'{"prompt": "hi", "temperature": 1e308}',
    b'{"prompt": "hi", "max_tokens": -1}', b'{"prompt": "hi", "n": 100000}', b'{"prompt": "hi", "logprobs": 1000}',
    b'{"prompt": "hi", "stop": ["' + b"x" * 5000 + b'"]}', b'{"prompt": "\ud800 lone surrogate"}',
    '{"prompt": "\u0000\u202e\ufeff\U0001f600 é́ 中"}'.encode(),
    b'{"prompt": [1, 2, 99999999]}', b'{"prompt": [[]]}', b'{"prompt": ""}', b'{"prompt": []}',
    b'{"prompt": "hi", "logit_bias": {"abc": 1}}', b'{"prompt": "hi", "stream": "yes"}',
])
def test_malformed_and_extreme_bodies_get_4xx(server, body):
    r = requests.post(server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=60)
    assert 400 <= r.status_code < 500 or r.status_code == 200, (r.status_code, r.text[:200])
    if r.status_code != 200:
        assert "error" in r.json() and r.json()["error"]["message"]


def test_prompts_of_every_length(server):
    limit = 96
    for n in (1, 2, limit - 2, limit - 1, limit, limit + 1, 5 * limit):
        r = requests.post(server.url + "/v1/completions", json={"prompt": [7] * n, "max_tokens": 1}, timeout=60)
        assert r.status_code == (200 if n < limit else 400), (n, r.text[:200])
    big = requests.post(server.url + "/v1/completions", data=b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}',
                        headers={"Content-Type": "application/json"}, timeout=60)
    assert big.status_code == 413
    assert requests.get(server.url + "/health").status_code == 200
