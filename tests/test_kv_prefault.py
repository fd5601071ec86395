"""The idle pre-fault of the KV cache: it writes only blocks that were never handed out, in pieces, and stops
when none are left; what requests wrote (and the prefix cache reads back) is untouched."""

from __future__ import annotations

import torch

import tokenmill.engine.engine_core as engine_core
from tokenmill import LLM, SamplingParams


def test_idle_prefault_writes_only_blocks_never_handed_out(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir("llama")), kv_cache_memory="4MiB")
    core = llm.engine_core
    pool = core.scheduler.kv_cache_manager.pool
    caches = core.executor.runner.kv_caches
    cc = core.config.cache_config
    block_bytes = cc.kv_bytes_per_token(core.config.model_config) * cc.block_size
    monkeypatch.setattr(engine_core, "PREFAULT_BYTES", 8 * block_bytes)   # 8 blocks a call
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def generate(prompt: list[int]) -> list[int]:
        return llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids

    generate(list(range(5, 45)))
    untouched = pool.high_water + 1
    for cache in caches:   # mark the blocks no request has had: the pre-fault may write those only
        cache[:, untouched:].fill_(1)
    assert core.prefault_idle_kv()
    assert all((c[:, untouched:untouched + 8] == 0).all() and (c[:, untouched + 8:] == 1).all() for c in caches)
    # a prompt of 40 blocks, placed in one run from the lowest free block, takes the 8 pre-faulted blocks and
    # more past them, past where the pre-fault stopped
    long_prompt = [(7 * i) % 500 + 3 for i in range(640)]
    first = generate(long_prompt)
    assert pool.high_water >= untouched + 18
    written = [c[:, : pool.high_water + 1].clone() for c in caches]
    calls = 0
    while core.prefault_idle_kv():
        calls += 1
    assert calls == -(-(pool.num_blocks - pool.high_water) // 8)
    assert not core.prefault_idle_kv()
    for cache, before in zip(caches, written):
        assert torch.equal(cache[:, : pool.high_water + 1], before)   # requests' blocks kept their values
        assert (cache[:, pool.high_water + 1:] == 0).all()              # every other block written once
    assert generate(long_prompt) == first                              # read back through the prefix cache
