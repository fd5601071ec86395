"""The engine core's side of structured output: a grammar per constrained request, the step's bitmask, and
keeping each grammar in step with the tokens the scheduler accepts.

The grammar lives on the scheduler's Request, so preemption keeps it: the request resumes with the tokens it
had, and its matcher has seen exactly those. Drafts are cut to the prefix the grammar allows before they are
scheduled, and verified under one mask per draft position.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenmill.config import ModelConfig
from tokenmill.structured_output.backend import LLGuidanceBackend, LLGuidanceGrammar
from tokenmill.utils import init_logger

logger = init_logger(__name__)


@dataclass
class GrammarBitmask:
    """Rows of packed allowed-token bits (int32 words, bit j of word w = token 32w + j); a constrained request's
    rows start at first_row[req_id]: one for its next token, then one per draft it verifies."""
    bitmask: torch.Tensor
    first_row: dict[str, int]


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, vocab_size: int):
        self.model_config = model_config
        self.vocab_size = vocab_size
        self._backend: LLGuidanceBackend | None = None
        self._lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None

    def backend(self) -> LLGuidanceBackend:
        """Built by the first constrained request's compile, on the compile thread (as vLLM does, lazily): built
        at start it held the GIL for seconds (transformers' tokenizer, llguidance's vocabulary tables) and made
        the requests around it 2-4x slower, whether or not anyone asked for a grammar."""
        with self._lock:
            if self._backend is None:
                from tokenmill.model.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self.model_config.tokenizer)
                self._backend = LLGuidanceBackend(tokenizer, self.vocab_size, self.model_config.eos_token_ids)
            return self._backend

    def grammar_for(self, request_id: str, params) -> LLGuidanceGrammar | Future | None:
        """The request's grammar: None without a constraint, a ready matcher when its grammar is compiled, else a
        Future of it, compiled on a thread while the engine keeps stepping (llguidance releases the GIL)."""
        so = params.structured_outputs
        if so is None:
            return None
        if not so.grammar_text:   # made in this process (offline use): translate and check it here
            from tokenmill.structured_output.grammar_text import validate

            validate(so)
        if self._backend is not None:
            hit = self._backend.cached(so.grammar_text, request_id)
            if hit is not None:
                return hit
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        return self._compiler.submit(lambda: self.backend().compile(so.grammar_text, request_id))

    def grammar_bitmask(self, scheduled: dict[str, int], drafts: dict[str, list[int]],
                        requests: dict) -> GrammarBitmask | None:
        """Masks for the constrained requests that sample this step (their known tokens all computed)."""
        rows, first_row, n = [], {}, 0
        for rid in scheduled:
            req = requests.get(rid)
            if req is None or req.grammar is None or req.num_computed_tokens < req.num_tokens:
                continue
            d = drafts.get(rid, [])
            rows.append((req.grammar, n, d))
            first_row[rid] = n
            n += 1 + len(d)
        if not rows:
            return None
        backend = self.backend()
        bitmask = torch.full((n, (backend.vocab_size + 31) // 32), -1, dtype=torch.int32)
        backend.fill_bitmask(rows, bitmask)
        return GrammarBitmask(bitmask, first_row)
