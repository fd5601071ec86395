"""A batch whose requests span several blocks gives the same tokens as each request alone."""

from __future__ import annotations

import random

import pytest

from tokenmill import SamplingParams


@pytest.mark.slow   # (make test keeps test_engine_real_model's mixed prompts against each alone)
def test_batch_equals_each_alone(smol_llm):
    rng = random.Random(7)
    lengths = [5, 16, 17, 33, 48, 64, 81, 100]
    prompts = [{"prompt_token_ids": [rng.randrange(200, 49000) for _ in range(n)]} for n in lengths]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert smol_llm.config.cache_config.block_size == 16
    together = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, sp, use_tqdm=False)]
    alone = [smol_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 20 for t in together)
