"""The grammar backend seam, and its llguidance implementation.

Chosen over xgrammar by measurement on this machine (SmolLM2 vocabulary, a five-field nested schema, random
walks of 150 tokens): a mask costs ~50 us with llguidance and ~15 us with xgrammar, both small against a
~10 ms decode step; but xgrammar's wheel depends on triton (~1 GB) and tvm-ffi, which a CPU install should not
carry, while llguidance has no dependencies and compiles a schema lazily (~1.5 ms against ~12 ms).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.utils import init_logger

logger = init_logger(__name__)


class RequestGrammar(Protocol):
    """One request's matcher: advanced by every accepted token, asked for the mask of the next one."""

    def accept(self, token_ids: list[int]) -> None: ...
    def num_valid(self, token_ids: list[int]) -> int: ...


@dataclass
class GrammarStats:
    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0


class LLGuidanceGrammar:
    def __init__(self, matcher, request_id: str = ""):
        self.matcher = matcher
        self.request_id = request_id

    def accept(self, token_ids: list[int]) -> None:
        m = self.matcher
        for t in token_ids:
            if m.is_stopped():
                return   # EOS was taken (the request ends there) or the grammar is complete
            if not m.consume_token(t):
                logger.error("request %s: token %d does not fit its grammar: %s", self.request_id, t, m.get_error())
                return

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of these drafts, from the start, the grammar allows (drafts past it are dropped)."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0


class LLGuidanceBackend:
    """Compiles each distinct grammar once (an LRU of fresh matchers) and copies it per request."""

    name = "guidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256,
                 num_threads: int | None = None):
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                         eos_token=list(eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=num_threads)
        self.cache: OrderedDict[str, object] = OrderedDict()
        self.cache_size = cache_size
        self.stats = GrammarStats()
        # The executor's first batch takes ~1.5 s here (its threads and per-vocabulary tables), whatever the grammar:
        # pay it now, off the engine step, not in the first constrained request's step.
        warm = llguidance.LLMatcher(self.ll_tokenizer, llguidance.LLMatcher.grammar_from_regex("[0-9]"), log_level=0)
        self.fill_bitmask([(LLGuidanceGrammar(warm), 0, [])],
                          torch.empty(1, (vocab_size + 31) // 32, dtype=torch.int32))

    def cached(self, grammar_text: str, request_id: str = "") -> LLGuidanceGrammar | None:
        """A matcher copied from the compiled grammar, or None when this grammar has not been compiled."""
        template = self.cache.get(grammar_text)
        if template is None:
            return None
        self.cache.move_to_end(grammar_text)
        self.stats.num_cache_hits += 1
        return LLGuidanceGrammar(template.deep_copy(), request_id)

    def compile(self, grammar_text: str, request_id: str = "") -> LLGuidanceGrammar:
        """Build the grammar and its first mask (llguidance builds lexer states lazily), then cache it. One thread
        compiles (the engine core's compile thread): the cache is only written here."""
        import llguidance

        hit = self.cached(grammar_text, request_id)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar_text, log_level=0)
        if not template.is_error():
            scratch = template.deep_copy()
            mask = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
            scratch.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if template.is_error():
            raise ValueError(f"the grammar does not compile: {template.get_error()}")
        self.stats.compile_seconds += time.perf_counter() - t0
        self.stats.num_compiled += 1
        self.cache[grammar_text] = template
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return LLGuidanceGrammar(template.deep_copy(), request_id)

    def fill_bitmask(self, rows: list[tuple[LLGuidanceGrammar, int, list[int]]], bitmask: torch.Tensor) -> None:
        """Row `first` of `bitmask` gets the mask after the accepted tokens, rows first+1.. the masks after each
        draft (llguidance rolls the drafts back); all rows of the batch at once, on its own threads."""
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        plain = [(g.matcher, first) for g, first, drafts in rows if not drafts]
        if plain:
            fill_next_token_bitmask_par(self.executor, plain, bitmask)
        with_drafts = [(g.matcher, first, drafts) for g, first, drafts in rows if drafts]
        if with_drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self.executor, with_drafts, bitmask)
