"""Prompt logprobs: each scheduled prompt position scores the next prompt token (vLLM's prompt_logprobs)."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.layers.sampler import SamplerOutput, gather_logprobs


def prompt_logprob_rows(inp, requests: dict, device):
    """(request, state, token rows, first position) for each request that asked for prompt logprobs and has
    some this step (rows None: nothing left to score); marks the requests whose prompt is then done."""
    qsl, seq_lens = inp.attn_metadata.query_start_loc_np, inp.attn_metadata.seq_lens_np
    for row, rid in enumerate(inp.req_ids):
        state = requests[rid]
        if state.sampling_params.prompt_logprobs is None or state.prompt_logprobs_sent:
            continue
        first_pos = int(seq_lens[row] - (qsl[row + 1] - qsl[row]))
        last_pos = min(int(seq_lens[row]), state.num_prompt_tokens - 1)   # positions scoring a prompt token
        if last_pos >= state.num_prompt_tokens - 1 or last_pos <= first_pos:
            state.prompt_logprobs_sent = True
        idx = (torch.arange(int(qsl[row]), int(qsl[row]) + last_pos - first_pos, device=device)
               if last_pos > first_pos else None)
        yield rid, state, idx, first_pos


def add_prompt_logprobs(model, inp, requests: dict, hidden: torch.Tensor, result: ModelRunnerOutput,
                        device) -> None:
    """Into result.prompt_logprobs, for the requests that asked. Position 0 has no logprob; the output side
    adds that None."""
    for rid, state, idx, first_pos in prompt_logprob_rows(inp, requests, device):
        if idx is None:
            result.prompt_logprobs[rid] = ([], [], [])
            continue
        logprobs = torch.log_softmax(model.compute_logits(hidden[idx]).float(), dim=-1)
        targets = torch.from_numpy(state.token_buf[first_pos + 1: first_pos + 1 + len(idx)].copy()).to(device)
        out = SamplerOutput(targets)
        gather_logprobs(logprobs, targets, state.sampling_params.prompt_logprobs, out)
        result.prompt_logprobs[rid] = (out.logprob_token_ids.tolist(), out.logprobs.tolist(),
                                       out.sampled_ranks.tolist())
