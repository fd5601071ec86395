"""Whisper's decoding rules on a step's logits, per request, before the batched sampler (transformers' and
Whisper's logits processors, in their order):

- language detection: a multilingual model's prompt that ends at <|startoftranscript|> samples a language token
  (Whisper's own detection: the most likely of them after it);
- suppress tokens are never sampled; at the first sampled position, neither are the blank and the end;
- with timestamps (a prompt without <|notimestamps|>): <|notimestamps|> is never sampled; timestamps come in
  pairs (after a lone one, a timestamp or the end; after a pair, text); they never decrease; the first token is
  a timestamp of at most 1.0 s; and where the timestamps' total probability beats every text token, a timestamp.
"""

from __future__ import annotations

import torch

from tokenmill.multimodal.whisper_tokens import MAX_INITIAL_TIMESTAMP_INDEX, WhisperTokens
from tokenmill.worker.input_batch import CachedRequestState


class WhisperLogitsRules:
    def __init__(self, tokens: WhisperTokens, device: str):
        self.t = tokens
        self.suppress = torch.tensor(tokens.suppress, dtype=torch.long, device=device)
        self.begin = torch.tensor(tokens.begin_suppress, dtype=torch.long, device=device)
        self.not_language = None
        if tokens.multilingual and tokens.languages:
            keep = torch.zeros(tokens.vocab_size, dtype=torch.bool, device=device)
            keep[list(tokens.languages.values())] = True
            self.not_language = ~keep

    def apply(self, logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
        """The logits (one row per state, scoring its next token) with the rules' tokens at -inf."""
        logits = logits.float()
        if len(self.suppress):
            logits[:, self.suppress] = -torch.inf
        ts = self.t.timestamp_begin
        for row, state in enumerate(states):
            prompt = state.token_buf[:state.num_prompt_tokens]
            first = state.num_tokens == state.num_prompt_tokens
            if first and self.not_language is not None and prompt[-1] == self.t.sot:
                logits[row, self.not_language[:logits.shape[1]]] = -torch.inf   # (detection: a language next)
                continue
            if first and len(self.begin):
                logits[row, self.begin] = -torch.inf
            if self.t.no_timestamps in prompt:
                continue   # (no timestamps: nothing of the output is read, so no per-step copy of it)
            self._timestamps(logits[row], state.token_buf[state.num_prompt_tokens:state.num_tokens].tolist(), ts)
        return logits

    def _timestamps(self, scores: torch.Tensor, out: list[int], ts: int) -> None:
        scores[self.t.no_timestamps] = -torch.inf
        last = len(out) >= 1 and out[-1] >= ts
        penultimate = len(out) < 2 or out[-2] >= ts
        if last:
            if penultimate:
                scores[ts:] = -torch.inf             # a pair just closed: text next
            else:
                scores[:self.t.eot] = -torch.inf     # a lone timestamp: another, or the end
        stamps = [t for t in out if t >= ts]
        if stamps:
            floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
            scores[ts:floor] = -torch.inf
        if not out:
            scores[:ts] = -torch.inf
            scores[ts + MAX_INITIAL_TIMESTAMP_INDEX + 1:] = -torch.inf
        logprobs = torch.log_softmax(scores, dim=-1)
        if torch.logsumexp(logprobs[ts:], dim=-1) > logprobs[:ts].max():
            scores[:ts] = -torch.inf
