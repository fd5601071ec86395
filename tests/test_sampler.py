"""The sampler's greedy fast path (an argmax over the model-dtype logits) agrees with its fp32 path."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata, apply_top_k


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


def test_draw_follows_the_weights_and_never_takes_a_zero_weight_token():
    """20,000 rows drawn from unnormalised weights: a chi-square test at the 0.1% level (fixed seed), and the
    zero-weight tokens (between, and after, the others) never drawn."""
    from scipy.stats import chisquare

    weights = torch.tensor([5.0, 0.0, 2.5, 1.5, 0.0, 1.0, 0.0, 0.0])
    n = 20_000
    drawn = Sampler(torch.Generator().manual_seed(1)).draw(weights.expand(n, -1), None)
    counts = torch.bincount(drawn, minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    nz = weights > 0
    expected = (weights[nz] / weights.sum() * n).tolist()
    assert chisquare(counts[nz].tolist(), expected).pvalue > 1e-3
    # a row on its own generator draws the same token whatever rows are around it
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    alone = Sampler(torch.Generator().manual_seed(2)).draw(weights[None], {0: gen()})
    among = Sampler(torch.Generator().manual_seed(3)).draw(weights.expand(5, -1), {3: gen()})
    assert alone[0] == among[3]


def _top_p_keep_reference(logits: torch.Tensor, top_p: float) -> set[int]:
    """Sort, and keep tokens until the kept mass reaches top_p (the one that crosses it included)."""
    p = logits.softmax(-1)
    order = p.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += float(p[i])
        if mass >= top_p:
            break
    return kept


def test_top_p_from_the_best_candidates_equals_sorting_the_row(monkeypatch):
    """Peaked rows find their cut among the best candidates, flat rows sort the whole row: both keep exactly
    what sorting keeps."""
    import tokenmill.layers.sampler as sampler

    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 16)
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, 500, generator=g) * 6
    flat = torch.randn(3, 500, generator=g) * 0.3
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.7, 0.9, 0.2, 0.6, 1.0])   # (the last row: off, in a batch with it on)
    logits = torch.cat([logits, peaked[:1]])
    out = sampler.apply_top_p(logits, top_p)
    assert torch.equal(out[-1], logits[-1])
    kept_counts = []
    for row in range(len(logits) - 1):
        kept = set(torch.nonzero(torch.isfinite(out[row]))[:, 0].tolist())
        assert kept == _top_p_keep_reference(logits[row], float(top_p[row])), row
        kept_counts.append(len(kept))
    assert max(kept_counts[:4]) <= 16 < min(kept_counts[4:6])   # both ways were taken


def test_top_k_leaves_rows_without_it_whole():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=g)
    out = apply_top_k(logits, torch.tensor([0, 5, 100]))
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    assert set(torch.nonzero(torch.isfinite(out[1]))[:, 0].tolist()) == set(logits[1].topk(5).indices.tolist())
