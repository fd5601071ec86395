"""Speculative decoding without a model: the config's errors, n-gram lookup, the scheduler's counters for drafts,
and the rejection sampler's distribution (a chi-square test against the target's own p)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.request import Request
from tokenmill.layers.sampler import Sampler, SamplingMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.config import check_against_max_model_len, parse_speculative_config
from tokenmill.spec_decode.proposer import ngram_lookup
from tokenmill.spec_decode.rejection_sampler import rejection_sample
from tokenmill.utils import cdiv

BS = 4


# ---- configuration ---------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_lookahead_tokens) == (4, 4, 0)
    spec = parse_speculative_config({"quantization": "int4", "num_speculative_tokens": 2})
    assert spec.method == "draft_model" and spec.model is None and spec.num_lookahead_tokens == 2
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("raw, field", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}, "lookup"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("{not json", "JSON"),
])
def test_config_errors_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(raw)


def test_too_many_speculative_tokens_for_max_model_len():
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 64})
    with pytest.raises(ValueError, match="num_speculative_tokens.*max_model_len"):
        check_against_max_model_len(spec, 64)


# ---- n-gram lookup ---------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_suffix_then_the_latest_occurrence():
    t = np.array([1, 2, 3, 9, 1, 2, 4, 7, 7, 1, 2])
    # suffix [1, 2]: latest earlier occurrence at index 4, followed by 4 7 7
    assert ngram_lookup(t, 1, 2, 3) == [4, 7, 7]
    # a 3-gram [7, 1, 2] does not occur earlier, so the 2-gram decides
    assert ngram_lookup(t, 2, 3, 2) == [4, 7]
    # proposals stop at the end of the known tokens
    assert ngram_lookup(np.array([5, 6, 5]), 1, 1, 4) == [6, 5]
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert ngram_lookup(np.array([8, 1, 2, 3, 1, 2]), 3, 3, 3) == []   # below prompt_lookup_min


# ---- the scheduler's counters ------------------------------------------------------------------------
def make_scheduler(num_blocks=64, budget=64, lookahead=0, max_len=256):
    return Scheduler(SchedulerConfig(budget, 8, max_len, True, "fcfs", num_lookahead_tokens=lookahead),
                     CacheConfig(BS, num_blocks, True))


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int) -> Request:
    req = Request(rid, [7 + i % 50 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  max_tokens, BS)
    s.add_request(req)
    return req


def step(s: Scheduler, accept: dict[str, int], propose: dict[str, list[int]]):
    """One step with a scripted runner: each request that samples keeps `accept[rid]` of its drafts, then one
    token; `propose` gives the next drafts."""
    so = s.schedule()
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        ids.append(rid)
        if req.num_computed_tokens >= req.num_tokens + len(drafts):   # its known tokens are all computed now
            a = min(accept.get(rid, 0), len(drafts))
            sampled.append(drafts[:a] + [99])
        else:
            sampled.append([])
    out = ModelRunnerOutput(ids, sampled, spec_token_ids={r: d for r, d in propose.items() if r in ids})
    return so, s.update_from_output(so, out)


def blocks_of(s: Scheduler, rid: str) -> int:
    return len(s.kv_cache_manager.req_to_blocks[rid])


def test_drafts_are_extra_tokens_and_rejected_slots_go_back():
    s = make_scheduler(lookahead=0)
    req = add(s, "a", 10, max_tokens=50)
    step(s, {}, {"a": [1, 2, 3, 4, 5, 6]})                  # prefill samples one token, proposes 6 drafts
    assert req.num_tokens == 11 and req.num_computed_tokens == 10 and req.spec_token_ids == [1, 2, 3, 4, 5, 6]
    so, _ = step(s, {"a": 1}, {"a": [6, 7]})
    assert so.num_scheduled_tokens["a"] == 1 + 6             # the last token and the six drafts
    assert so.scheduled_spec_decode_tokens["a"] == [1, 2, 3, 4, 5, 6]
    # one accepted, four rejected: computed steps back to the accepted tokens, the new token is not computed yet
    assert req.output_token_ids == [99, 1, 99] and req.num_computed_tokens == 12 and req.num_tokens == 13
    assert blocks_of(s, "a") == cdiv(13, BS)                 # 17 slots had been allocated: the rejected tail went back
    so, _ = step(s, {"a": 2}, {})
    assert so.scheduled_cached_reqs[0].num_kept_block_ids == 4   # the runner is told to drop the trimmed block
    assert req.num_computed_tokens == 15 and req.num_tokens == 16
    stats = s.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (2, 8, 3)
    assert stats.spec_accepted_per_pos == [2, 1, 0, 0, 0, 0]


def test_drafts_stop_at_max_tokens_and_budget():
    s = make_scheduler(budget=4)
    req = add(s, "a", 4, max_tokens=3)
    step(s, {}, {"a": [1, 2, 3, 4, 5, 6]})
    so, _ = step(s, {"a": 9}, {})
    # two more tokens are allowed: one draft and the target's own token
    assert so.scheduled_spec_decode_tokens["a"] == [1]
    assert req.num_output_tokens == 3 and req.status.finished
    s = make_scheduler(budget=3)
    add(s, "b", 3, max_tokens=20)
    step(s, {}, {"b": [1, 2, 3, 4]})
    so, _ = step(s, {}, {})
    assert so.total_num_scheduled_tokens <= 3 and so.scheduled_spec_decode_tokens["b"] == [1, 2]


def test_lookahead_slots_and_clean_drain():
    s = make_scheduler(num_blocks=40, lookahead=3)
    reqs = [add(s, f"r{i}", 5 + 3 * i, max_tokens=12) for i in range(4)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        ids = [r.request_id for r in reqs if not r.status.finished]
        step(s, {rid: int(rng.integers(0, 4)) for rid in ids}, {rid: [5, 6, 7] for rid in ids})
        for r in reqs:
            if not r.status.finished and r.request_id in s.kv_cache_manager.req_to_blocks:
                # every known token and the draft model's lookahead have slots
                assert blocks_of(s, r.request_id) * BS >= r.num_computed_tokens
    assert all(r.status.finished and r.num_output_tokens == 12 for r in reqs)
    pool = s.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


# ---- the rejection sampler ---------------------------------------------------------------------------
def _chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = expected >= 5   # pool the rare outcomes so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum()).astype(np.float64)
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    exp[-1] += obs.sum() - exp.sum()   # exact totals, as chisquare checks them
    return float(chisquare(obs, exp).pvalue)


def test_rejection_sampler_keeps_the_target_distribution():
    """Draws of the first two output tokens with drafts proposed for both positions: the joint distribution must be
    the target's p(t1) p(t2 | t1), whatever the drafts (here a likely token and an unlikely one)."""
    vocab, n = 6, 20000
    torch.manual_seed(0)
    p1 = torch.softmax(torch.randn(vocab) * 1.5, 0)
    p2 = torch.softmax(torch.randn(vocab, vocab) * 1.5, 1)   # p(t2 | t1)
    drafts = [int(p1.argmax()), int(p2[int(p1.argmax())].argmin())]
    # row 0 scores t1; row 1 scores t2 given the first draft; row 2 is the bonus row (not reached on rejection)
    logits = torch.log(torch.stack([p1, p2[drafts[0]], p2[drafts[1]]]))
    md = SamplingMetadata(temperature=torch.ones(3), all_greedy=False)
    sampler = Sampler(torch.Generator().manual_seed(1))
    counts = np.zeros((vocab, vocab))
    t2_after_rejection = torch.Generator().manual_seed(2)
    for _ in range(n):
        out = rejection_sample(sampler, logits.clone(), md, [drafts], [None]).token_ids[0]
        t1 = out[0]
        t2 = out[1] if len(out) > 1 else int(torch.multinomial(p2[t1], 1, generator=t2_after_rejection))
        counts[t1, t2] += 1
    expected = (p1[:, None] * p2).numpy() * n
    p_value = _chi_square_p_value(counts.ravel(), expected.ravel())
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}: the output is not distributed as the target"
    # and the test has power: the classic bug of drawing from p instead of the residual after a rejection skews
    # t1 towards the draft; counts in that proportion would fail by far
    x = drafts[0]
    wrong_p1 = (1 - p1[x]) * p1
    wrong_p1[x] += p1[x]
    wrong = np.round((wrong_p1[:, None] * p2).numpy() * n)
    assert _chi_square_p_value(wrong.ravel(), expected.ravel()) < 1e-6


def test_greedy_rows_accept_only_the_argmax_and_seeds_repeat():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    md = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True)
    out = rejection_sample(Sampler(), logits.clone(), md, [[1, 2]], [None])
    assert out.token_ids == [[1, 0]]   # the first draft is the argmax, the second is not: the argmax replaces it
    md = SamplingMetadata(temperature=torch.ones(3), all_greedy=False)
    draws = [rejection_sample(Sampler(), logits.clone(), md, [[1, 2]], [torch.Generator().manual_seed(7)]).token_ids
             for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
