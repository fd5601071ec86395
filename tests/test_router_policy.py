"""The router's choice, without processes: a prefix sticks to one replica, a hot prefix spills once its replica
carries more than its bounded share, weights set the traffic share (a canary), and a removed replica moves only
its own keys."""

from __future__ import annotations

import random

import pytest

from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.router.backends import Backend, parse_backend, read_backends_file
from tokenmill.router.policy import PrefixKeyer, Router


def _backends(*weights: float) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000", w, healthy=True) for i, w in enumerate(weights)]


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def test_the_key_is_the_engines_chained_hash_of_the_first_blocks():
    keyer = PrefixKeyer(None, block_size=4, max_blocks=2)
    ids = list(range(100, 111))   # 2 full blocks and 3 more tokens: only the first 2 blocks count
    hashes: list = []
    extend_block_hashes(hashes, ids[:8], 4, b"")
    assert keyer.key_for({"prompt": ids}, chat=False) == hashes[-1].value
    assert keyer.key_for({"prompt": ids[:8] + [1, 2, 3]}, chat=False) == hashes[-1].value
    assert keyer.key_for({"prompt": [5, 6, 7]}, chat=False) is None   # shorter than a block: routed by load
    assert keyer.key_for({"prompt": ids, "cache_salt": "tenant-a"}, chat=False) != hashes[-1].value


def test_one_prefix_sticks_to_one_replica_while_loads_are_even():
    backends, router = _backends(1, 1, 1), Router()
    for key in _keys(50):
        first = router.choose(backends, key)
        again = router.choose(backends, key)
        assert first.backend is again.backend and again.reason == "affinity" and again.cache_hit


def test_a_hot_prefix_spills_past_its_bounded_share():
    backends, router = _backends(1, 1), Router(load_factor=1.25)
    key = _keys(1)[0]
    for _ in range(20):   # 20 in flight, none finishing
        router.choose(backends, key).backend.outstanding += 1
    home = max(backends, key=lambda b: b.outstanding)
    assert home.outstanding <= 1.25 * 20 / 2 + 1 and min(b.outstanding for b in backends) >= 7


def test_weights_set_the_share_a_canary_gets():
    backends, router = _backends(1, 0.1), Router()
    got = [router.choose(backends, key).backend for key in _keys(4000)]
    share = got.count(backends[1]) / len(got)
    assert 0.05 < share < 0.15, share
    parked = _backends(1, 0)
    assert [b for b in parked if b.routable] == parked[:1]   # weight 0: out of rotation, still health-checked


def test_removing_a_replica_moves_only_its_keys():
    backends, router = _backends(1, 1, 1, 1), Router()
    keys = _keys(400)
    before = {k: router.choose(backends, k).backend.url for k in keys}
    gone = backends.pop(2).url
    after = {k: router.choose(backends, k).backend.url for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != gone)
    assert all(after[k] != gone for k in keys)


def test_least_loaded_counts_the_replicas_queue():
    backends, router = _backends(1, 1), Router()
    backends[0].waiting = 5
    assert all(router.choose(backends, None).backend is backends[1] for _ in range(10))


def test_bad_backend_specs_are_errors_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--backend"):
        parse_backend("localhost:8000")
    with pytest.raises(ValueError, match="--weight"):
        parse_backend("http://a:1", -1)
    f = tmp_path / "backends"
    f.write_text("# replicas\nhttp://a:1/ 2\n\nhttp://b:2  # canary? no: full weight\n")
    assert [(b.url, b.weight) for b in read_backends_file(str(f))] == [("http://a:1", 2.0), ("http://b:2", 1.0)]


def test_admin_routes_need_the_key_when_one_is_set():
    from fastapi.testclient import TestClient

    from tokenmill.router.app import build_router_app
    from tokenmill.router.backends import BackendPool

    pool = BackendPool([parse_backend("http://127.0.0.1:9")], health_interval=60, timeout=0.2)
    with TestClient(build_router_app(pool, None, admin_key="secret")) as client:
        assert client.get("/router/backends").status_code == 401
        r = client.post("/router/remove", json={"url": "http://127.0.0.1:9"},
                        headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = client.get("/router/backends", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200 and ok.json()["backends"][0]["url"] == "http://127.0.0.1:9"
        assert client.get("/health").status_code == 503   # open, like a replica's


def _instance(role: str, kv_role: str | None, **layout) -> Backend:
    b = parse_backend("http://127.0.0.1:1")
    b.role = role
    base = {"model": "m", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16,
            "kv_dtype": "bfloat16"}
    b.kv_transfer = {"role": kv_role, "address": "tcp://127.0.0.1:2", "layout": {**base, **layout}} if kv_role else None
    return b


def test_disaggregated_instances_need_their_role_and_one_kv_layout():
    from tokenmill.router.backends import BackendPool

    pool = BackendPool([], pairing={})
    assert pool.pairing_problem(_instance("prefill", "kv_producer")) is None       # sets the layout
    assert pool.pairing_problem(_instance("decode", "kv_both")) is None
    assert "kv_consumer or kv_both" in pool.pairing_problem(_instance("decode", "kv_producer"))
    assert "needs --kv-transfer-config" in pool.pairing_problem(_instance("prefill", None))
    problem = pool.pairing_problem(_instance("decode", "kv_consumer", kv_dtype="fp8_e4m3fn", block_size=32))
    assert "block_size 32 vs 16" in problem and "kv_dtype 'fp8_e4m3fn' vs 'bfloat16'" in problem


def test_disaggregated_flags_go_together():
    import argparse

    from tokenmill.router.cli import add_router_parser, run_router

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    for argv in (["--prefill", "http://127.0.0.1:1"], ["--decode", "http://127.0.0.1:1"],
                 ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--backend", "http://x:3"]):
        with pytest.raises(ValueError, match="--prefill URL and --decode URL"):
            run_router(parser.parse_args(["router", *argv]))
