"""The sampler's greedy fast path (an argmax over the model-dtype logits) agrees with its fp32 path."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata


def test_greedy_under_min_tokens_skips_the_stop_tokens_like_the_fp32_path():
    """Rows still under min_tokens whose best token is a stop token take their best other token; the bf16
    argmax path and the fp32 path (taken when logprobs are asked for) pick the same tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    best = logits.float().argmax(dim=-1)
    mask = [(0, [int(best[0]), 7]), (3, [int(best[3])]), (4, [5])]
    md = SamplingMetadata(temperature=torch.zeros(6), all_greedy=True, stop_token_mask=mask)
    fast = Sampler()(logits.clone(), md).sampled
    slow = Sampler()(logits.clone(), SamplingMetadata(temperature=torch.zeros(6), all_greedy=True,
                                                      stop_token_mask=mask, max_num_logprobs=0)).sampled
    assert torch.equal(fast, slow)
    assert fast[0] != best[0] and fast[3] != best[3]
    assert torch.equal(fast[[1, 2, 4, 5]], best[[1, 2, 4, 5]])
