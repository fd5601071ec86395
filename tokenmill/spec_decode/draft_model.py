"""A draft model in the engine's own process: a smaller model, or the target's own weights at 4 bits.

It keeps its own paged KV cache with the same number of blocks and writes it through the target's block
tables (the scheduler allocates `num_speculative_tokens` lookahead slots for it). Per request it remembers
how many leading tokens its cache holds; each proposal first catches up on the tokens it has not seen (a
whole prompt the first time; after a verification, the one or two tokens past its last accepted draft),
then drafts greedily one token per pass.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.attention import allocate_kv_caches
from tokenmill.layers.sampler import greedy_tokens
from tokenmill.model.loader import DTYPES, load_model
from tokenmill.spec_decode.proposer import NoObservation
from tokenmill.utils import init_logger
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import varlen_batch

logger = init_logger(__name__)


class DraftModelProposer(NoObservation):
    def __init__(self, config: EngineConfig, backend, device: str):
        self.k = config.speculative_config.num_speculative_tokens
        self.model_config = config.draft_model_config
        self.max_model_len = config.scheduler_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.device = device
        self.model = load_model(self.model_config, backend, device, self.max_model_len)
        self.num_computed: dict[str, int] = {}   # leading tokens of each request in the draft's cache
        self.kv_caches: list[torch.Tensor] = []

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model.attention_layers(), num_blocks, block_size,
                                            DTYPES[self.model_config.dtype], self.device, "draft model KV cache")

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.num_computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        # at most k drafts, and never a position past max_model_len - 1
        budget = [min(self.k, self.max_model_len - s.num_tokens) for s in states]
        states = [s for s, b in zip(states, budget) if b > 0]
        budget = [b for b in budget if b > 0]
        if not states:
            return {}
        # drafts past the last accepted one were written with tokens the target did not keep: recompute them
        start = np.array([min(self.num_computed.get(s.req_id, 0), s.num_tokens - 1) for s in states], dtype=np.int64)
        ends = np.array([s.num_tokens for s in states], dtype=np.int64)
        drafts: list[list[int]] = [[] for _ in states]
        live = list(range(len(states)))
        for _ in range(max(budget)):
            batch = [states[i] for i in live]
            input_ids, positions, md = varlen_batch(batch, start[live], ends[live] - start[live], self.block_size,
                                                    device=self.device)
            hidden = self.model(input_ids, positions, md)
            last = torch.from_numpy(md.query_start_loc_np[1:] - 1).to(hidden.device)
            tokens = greedy_tokens(self.model.compute_logits(hidden[last])).tolist()
            for i, tok in zip(live, tokens):
                drafts[i].append(tok)
                states[i].write_drafts(drafts[i])   # the next pass reads its input from the token buffer
            start[live] = ends[live]
            ends[live] += 1
            live = [i for i in live if len(drafts[i]) < budget[i]]
            if not live:
                break
        for i, s in enumerate(states):
            self.num_computed[s.req_id] = int(start[i])   # the last draft was proposed, never fed
        return {s.req_id: d for s, d in zip(states, drafts)}
