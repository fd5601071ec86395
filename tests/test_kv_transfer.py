"""Disaggregated prefill and decode at the engine level: a decode instance that pulls a prompt's KV blocks from a
prefill instance answers exactly as one instance computing everything (greedy, fp32), computes only the tail of
the prompt, and refuses blocks of another layout."""

from __future__ import annotations

import random
import socket
import threading
from contextlib import contextmanager

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv_transfer.config import parse_kv_transfer_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transfer(role: str, port: int) -> dict:
    return {"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": port,
            "kv_connector_extra_config": {"timeout": 5}}


@contextmanager
def _serving(producer: LLM):
    """Answer pulls on a thread while the test's own thread runs the consumer (the producer is idle)."""
    stop = threading.Event()

    def loop():
        sock = producer.engine_core.kv_connector.socket
        while not stop.is_set():
            if sock.poll(10):
                producer.engine_core.serve_kv()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length + 7 * i)] for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    port = _free_port()
    common = dict(dtype="float32", kv_cache_memory="32MiB", block_size=16)
    producer = LLM(folder, kv_transfer_config=_transfer("kv_producer", port), **common)
    consumer = LLM(folder, kv_transfer_config=_transfer("kv_consumer", port), **common)
    yield folder, port, producer, consumer
    producer.shutdown()
    consumer.shutdown()


def test_decode_instance_answers_as_one_instance(pair):
    folder, port, producer, consumer = pair
    prompts = _prompts(4, 70)
    alone = [o.outputs[0].token_ids for o in producer.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                                 use_tqdm=False)]
    producer.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    # the prefill step: one token, which leaves the prompt's full blocks in the producer's prefix cache
    producer.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    address = f"tcp://127.0.0.1:{port}"
    with _serving(producer):
        outs = consumer.generate([{"prompt_token_ids": p, "kv_transfer_params": {"remote_address": address}}
                                  for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    full_blocks = [(len(p) - 1) // 16 for p in prompts]
    assert consumer.engine_core.kv_connector.num_received_blocks == sum(full_blocks)
    assert [o.num_cached_tokens for o in outs] == [16 * b for b in full_blocks]   # only the tail was computed


def test_a_silent_producer_costs_only_time(pair):
    """Nobody listens at the address: after the timeout the decode instance computes the prompt itself."""
    folder, port, producer, consumer = pair
    prompt = _prompts(1, 40, seed=3)[0]
    alone = producer.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    consumer.engine_core.kv_connector.transfer = parse_kv_transfer_config(
        {**_transfer("kv_consumer", port), "kv_connector_extra_config": {"timeout": 0.5}})
    out = consumer.generate([{"prompt_token_ids": prompt,
                              "kv_transfer_params": {"remote_address": f"tcp://127.0.0.1:{_free_port()}"}}],
                            GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone and out.num_cached_tokens == 0


def test_blocks_of_another_layout_are_refused(pair):
    folder, port, producer, _ = pair
    other = LLM(folder, dtype="float32", kv_cache_memory="32MiB", block_size=32,
                kv_transfer_config=_transfer("kv_consumer", _free_port()))
    prompt = _prompts(1, 80, seed=5)[0]
    producer.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    with _serving(producer), pytest.raises(ValueError, match="layout does not match.*block_size 16 vs 32"):
        other.generate([{"prompt_token_ids": prompt,
                         "kv_transfer_params": {"remote_address": f"tcp://127.0.0.1:{port}"}}], GREEDY,
                       use_tqdm=False)
    other.shutdown()


def test_quantized_blocks_travel_with_their_offsets(tiny_model_dir):
    """fp8 blocks (K stored less the offsets both instances calibrated at start) continue on the decode instance
    as on the prefill instance itself, from its prefix cache; offsets that differ are refused."""
    folder, port = str(tiny_model_dir("llama")), _free_port()
    common = dict(dtype="float32", kv_cache_memory="32MiB", block_size=16, kv_cache_dtype="fp8")
    producer = LLM(folder, kv_transfer_config=_transfer("kv_producer", port), **common)
    consumer = LLM(folder, kv_transfer_config=_transfer("kv_consumer", port), **common)
    assert producer.engine_core.executor.runner.model.attention_layers()[0].k_offset is not None
    prompts = _prompts(3, 60, seed=11)
    producer.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    from_cache = [o.outputs[0].token_ids for o in producer.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    GREEDY, use_tqdm=False)]
    address = f"tcp://127.0.0.1:{port}"
    with _serving(producer):
        outs = consumer.generate([{"prompt_token_ids": p, "kv_transfer_params": {"remote_address": address}}
                                  for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == from_cache
        assert consumer.engine_core.kv_connector.num_received_blocks > 0
        layer = consumer.engine_core.executor.runner.model.attention_layers()[1]
        layer.k_offset = layer.k_offset + 0.5
        consumer.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
        with pytest.raises(ValueError, match="other offsets"):
            consumer.generate([{"prompt_token_ids": prompts[0], "kv_transfer_params": {"remote_address": address}}],
                              GREEDY, use_tqdm=False)
    producer.shutdown()
    consumer.shutdown()


@pytest.mark.parametrize("config, field", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector"),
    ({"kv_connector": "ZmqConnector", "kv_role": "sender"}, "kv_role"),
    ({"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": 70000}, "kv_port"),
    ({"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_buffer": 1}, "unknown key"),
    ('{"kv_connector": ', "JSON"),
])
def test_bad_kv_transfer_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        parse_kv_transfer_config(config)


def test_kv_transfer_params_need_a_consumer(smol_llm):
    with pytest.raises(ValueError, match="kv_transfer_params"):
        smol_llm.generate([{"prompt_token_ids": [1, 2, 3],
                            "kv_transfer_params": {"remote_address": "tcp://127.0.0.1:1"}}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="remote_address"):
        smol_llm.generate([{"prompt_token_ids": [1, 2, 3], "kv_transfer_params": {"remote_address": 5}}], GREEDY,
                          use_tqdm=False)
