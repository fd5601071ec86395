"""Incremental detokenization and stop strings.

Decoding a window (a few tokens of context + the new ones) and emitting only the new suffix keeps text
right across multi-byte characters and tokenizers that merge spaces; a trailing U+FFFD means the character
is not complete yet, so nothing is emitted until it is.
"""

from __future__ import annotations

from functools import lru_cache

_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset: self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if len(self.ids) > 4 * _CONTEXT + 64:  # keep the window short: decode cost must not grow with length
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        return full[len(prefix):]


def find_stop(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the last `new_len` characters of `text`.
    Returns (the stop string, where the text is cut) or None."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    if best is None:
        return None
    stop, i = best
    return stop, i + len(stop) if include else i


def token_text_cache(tokenizer):
    """Per-token text for logprobs, cached: the same ids come back every step."""

    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return text
