"""Verifies drafts against the target's own distribution, so speculation never changes what is said.

Every proposer here drafts deterministically (n-gram lookup, a draft model's argmax), so the draft
distribution q is one-hot at the drafted token x. The rejection sampler of Leviathan et al. / Chen et al.
then reads: accept x with probability min(1, p(x) / q(x)) = p(x); at the first rejection draw from the
residual max(p - q, 0), which is p with x removed; when every draft is accepted draw one more token from
the next position's p. Each output token is then distributed exactly as the target's p. A greedy row
accepts a draft iff it is the argmax, and its next token is the argmax where the first draft failed.

Uniforms and draws come from the request's own generator when it has a seed, so a seeded request is
reproducible whatever else runs in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampler import _EPS, Sampler, SamplingMetadata, greedy_tokens


@dataclass
class VerifiedTokens:
    token_ids: list[list[int]]            # per request: its accepted drafts, then one token of the target
    rows: list[list[int]]                 # the logits row each of those tokens came from
    raw_logprobs: torch.Tensor | None     # [rows, vocab] log-softmax of the raw logits, when logprobs are asked


def rejection_sample(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]],
                     generators: list[torch.Generator | None]) -> VerifiedTokens:
    """logits: [sum(len(d) + 1), vocab], request i's rows consecutive: one per draft, then the bonus row.
    `md` is laid out by the same rows (each row's penalties and min_tokens count the drafts before it)."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    logits, raw_logprobs = sampler.prepare(logits, md)
    targets = greedy_tokens(logits).tolist()
    probs = None
    if not md.all_greedy:
        probs = sampler.probs(logits, md)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves it unnormalised: acceptance needs p(x)
    greedy = (md.temperature < _EPS).tolist()
    out_tokens: list[list[int]] = []
    out_rows: list[list[int]] = []
    final_rows, rejected, draw_rows = [], [], []
    for i, (start, d) in enumerate(zip(starts, drafts)):
        if greedy[start]:
            a = _greedy_accepts(d, targets[start: start + len(d)])
            out_tokens.append(d[:a] + [targets[start + a]])
        else:
            a = _sampled_accepts(d, probs, start, generators[i] or sampler.default_generator)
            out_tokens.append(d[:a] + [-1])   # the last token comes from the draw below
            draw_rows.append(i)
            final_rows.append(start + a)
            rejected.append(d[a] if a < len(d) else -1)
        out_rows.append(list(range(start, start + a + 1)))
    if draw_rows:
        final = probs[final_rows].clone()
        for j, tok in enumerate(rejected):
            if tok >= 0:
                final[j, tok] = 0.0   # the residual max(p - onehot(x), 0)
        gens = {j: generators[i] for j, i in enumerate(draw_rows) if generators[i] is not None}
        for i, tok in zip(draw_rows, sampler.draw(final, gens).tolist()):
            out_tokens[i][-1] = tok
    return VerifiedTokens(out_tokens, out_rows, raw_logprobs)


def _greedy_accepts(drafts: list[int], targets: list[int]) -> int:
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def _sampled_accepts(drafts: list[int], probs: torch.Tensor, start: int, gen: torch.Generator | None) -> int:
    if not drafts:
        return 0
    p_draft = probs[torch.arange(start, start + len(drafts), device=probs.device),
                    torch.tensor(drafts, device=probs.device)]
    u = torch.rand(len(drafts), generator=gen, device=probs.device)
    accepted = (u < p_draft).tolist()
    a = 0
    while a < len(drafts) and accepted[a]:
        a += 1
    return a
