"""The sampler's per-row tensors for a step: temperatures, top-k/p, min-p, penalties, biases and min-token masks."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.worker.input_batch import CachedRequestState


def sampling_metadata(states: list[CachedRequestState], dev: str,
                      draft_prefixes: list[list[int]] | None = None) -> SamplingMetadata:
    """One row per state; with drafts, a state is repeated for each row that verifies one, and its row's
    output so far includes the drafts before it (penalties and min_tokens count them)."""
    extra = draft_prefixes or [[] for _ in states]
    sps = [s.sampling_params for s in states]
    temperature = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=dev)
    all_greedy = all(sp.greedy for sp in sps)
    md = SamplingMetadata(temperature=temperature, all_greedy=all_greedy)
    if not all_greedy:
        if any(sp.top_k > 0 for sp in sps):
            md.top_k = torch.tensor([sp.top_k for sp in sps], dtype=torch.int64, device=dev)
        if any(sp.top_p < 1.0 for sp in sps):
            md.top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=dev)
        if any(sp.min_p > 0.0 for sp in sps):
            md.min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32, device=dev)
        md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
    wanted = [sp.logprobs for sp in sps if sp.logprobs is not None]
    md.max_num_logprobs = max(wanted) if wanted else None
    if any(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 for sp in sps):
        md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)
        md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)
        md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)
        md.prompt_token_ids = [s.token_buf[: s.num_prompt_tokens].tolist() for s in states]
        md.output_token_ids = [s.output_token_ids + e for s, e in zip(states, extra)]
    if any(sp.logit_bias for sp in sps):
        md.logit_bias = [sp.logit_bias for sp in sps]
    under_min = [(i, sorted(sp.all_stop_token_ids)) for i, (s, sp, e) in enumerate(zip(states, sps, extra))
                 if sp.min_tokens and s.num_tokens + len(e) - s.num_prompt_tokens < sp.min_tokens
                 and sp.all_stop_token_ids]
    md.stop_token_mask = under_min or None
    return md
