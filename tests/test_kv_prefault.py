"""The KV cache's pre-faults: ahead of the blocks handed out (before each step) and while idle. Both write only
blocks that were never handed out, in id order; what requests wrote (and the prefix cache reads back) is
untouched."""

from __future__ import annotations

import torch

import tokenmill.engine.engine_core as engine_core
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(640)]   # 40 blocks, in 64-token chunks
SMALL_STEPS = dict(kv_cache_memory="4MiB", max_num_batched_tokens=64, max_num_seqs=2)


def _generate(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _setup(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), **SMALL_STEPS)
    core = llm.engine_core
    return llm, core, core.scheduler.kv_cache_manager.pool, core.executor.runner.kv_caches


def test_blocks_are_written_one_step_ahead_of_the_requests(tiny_model_dir, monkeypatch):
    llm, core, pool, caches = _setup(tiny_model_dir)
    assert pool.num_blocks > 3 * 40
    first_free = pool.high_water + 1
    for cache in caches:   # mark every block no request has had yet, written ahead or not
        cache[:, first_free:].fill_(1)
    start_frontier = core._prefault_next   # (the pre-faults' frontier: blocks below it were written at the start)
    out = _generate(llm, LONG_PROMPT)
    high = pool.high_water   # the request's last block (its run starts at the lowest free block)
    assert high == 41 and high > start_frontier
    for cache in caches:
        # K/V of 645 tokens: rows 5-15 of the last block were never the request's, yet they were written (zeros)
        # before it took the block
        assert (cache[:, high, 8:] == 0).all()
        assert (cache[:, high + 1: core._prefault_next] == 0).all()   # and the blocks written ahead of it
        assert (cache[:, -1] == 1).all()                               # the pool's far end, never written
    monkeypatch.setattr(engine_core.EngineCore, "prefault_ahead", lambda self: None)
    lazy, _, _, _ = _setup(tiny_model_dir)
    assert _generate(lazy, LONG_PROMPT) == out   # no block a request had was written over


def test_idle_prefault_goes_on_from_the_blocks_written_ahead(tiny_model_dir, monkeypatch):
    llm, core, pool, caches = _setup(tiny_model_dir)
    cc = core.config.cache_config
    block_bytes = cc.kv_bytes_per_token(core.config.model_config) * cc.block_size
    monkeypatch.setattr(engine_core, "PREFAULT_BYTES", 8 * block_bytes)   # 8 blocks a call
    _generate(llm, list(range(5, 45)))
    untouched = pool.high_water + 1
    ahead = core._prefault_next   # (the pre-faults' frontier: written ahead up to here)
    assert ahead > untouched
    for cache in caches:   # mark the blocks no request has had
        cache[:, untouched:].fill_(1)
    assert core.prefault_idle_kv()
    for cache in caches:   # the next 8 past the frontier; the ones before it were written once already
        assert (cache[:, ahead:ahead + 8] == 0).all() and (cache[:, ahead + 8:] == 1).all()
        assert (cache[:, untouched:ahead] == 1).all()
    first = _generate(llm, LONG_PROMPT)   # 40 blocks in one run from the lowest free block, past the frontier
    assert pool.high_water >= ahead + 8
    written = [c[:, : pool.high_water + 1].clone() for c in caches]
    frontier, calls = core._prefault_next, 0
    while core.prefault_idle_kv():
        calls += 1
    assert calls == -(-(pool.num_blocks + 1 - frontier) // 8)   # 8 blocks a call from the frontier to the end
    assert not core.prefault_idle_kv()
    for cache, before in zip(caches, written):
        assert torch.equal(cache[:, : pool.high_water + 1], before)   # requests' blocks kept their values
        assert (cache[:, pool.high_water + 1:] == 0).all()              # every other block written
    assert _generate(llm, LONG_PROMPT) == first                        # read back through the prefix cache


def test_a_step_with_nothing_to_write_ahead_does_not_end_the_prefaults(tiny_model_dir, monkeypatch):
    """The blocks handed out can run past the pre-faults' frontier (a request's run placed beyond a gap kept for
    another's growth); a step that then wants nothing written ahead (no request to schedule) must leave the
    pre-faults going: only the pool's end, or an executor that does not pre-fault, ends them."""
    llm, core, pool, caches = _setup(tiny_model_dir)
    cc = core.config.cache_config
    monkeypatch.setattr(engine_core, "PREFAULT_BYTES", 8 * cc.kv_bytes_per_token(core.config.model_config)
                        * cc.block_size)   # 8 blocks a call
    _generate(llm, LONG_PROMPT)
    assert not core.scheduler.has_unfinished_requests() and pool.high_water > 40
    core._prefault_next = 1   # behind the blocks handed out by more than a pre-fault's minimum
    core.prefault_ahead()     # nothing scheduled: nothing to write
    for cache in caches:
        cache[:, pool.high_water + 1:].fill_(1)
    assert core.prefault_idle_kv()   # the idle pre-fault still writes, from past the blocks handed out
    first = pool.high_water + 1
    for cache in caches:
        assert (cache[:, first: first + 8] == 0).all() and (cache[:, first + 8:] == 1).all()
