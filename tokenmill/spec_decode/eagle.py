"""The EAGLE proposer: a draft head fed with the target's hidden states (model/eagle.py has the head).

Every step, the head first runs over the same positions the target just computed ("mirrors" it), pairing
each position's target hidden state with the token after it, so its own KV cache (same block tables) always
holds every position whose next token is known; rejected drafts are left out, so nothing needs undoing. The
mirror's last row, at the newest token, gives the first draft; each further draft is one pass that feeds the
head's own output back in place of the target's hidden state.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.sampler import greedy_tokens
from tokenmill.model.eagle import EagleHead, eagle_checkpoint_tensors
from tokenmill.model.loader import DTYPES
from tokenmill.utils import format_bytes, init_logger
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import varlen_batch

logger = init_logger(__name__)


class EagleProposer:
    def __init__(self, config: EngineConfig, backend, device: str, target: torch.nn.Module):
        self.k = config.speculative_config.num_speculative_tokens
        self.model_config = config.draft_model_config
        self.max_model_len = config.scheduler_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.device = device
        self.target = target
        self.head = _load_head(self.model_config, backend, device, self.max_model_len,
                               target.model.embed_tokens.weight)
        self.last_hidden: dict[str, torch.Tensor] = {}   # the mirror's output at each request's newest token

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        m = self.model_config
        shape = (2, num_blocks, block_size, m.num_kv_heads, m.head_dim)
        caches = [torch.zeros(shape, dtype=DTYPES[m.dtype], device=self.device) for _ in range(m.num_layers)]
        for layer, cache in zip(self.head.attention_layers(), caches):
            layer.kv_cache = cache
        logger.info("EAGLE head KV cache: %d layers x %s = %s", m.num_layers, tuple(shape),
                    format_bytes(sum(t.numel() * t.element_size() for t in caches)))

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.last_hidden.pop(rid, None)

    @torch.inference_mode()
    def observe(self, states: list[CachedRequestState], qsl: np.ndarray, seq_lens: np.ndarray,
                hidden: torch.Tensor) -> None:
        """states: every request of the step, with its verified tokens appended; hidden: the target's output for
        the step's tokens (query_start_loc qsl, context seq_lens)."""
        self.last_hidden.clear()
        rows, start, n, feats = [], [], [], []
        for r, s in enumerate(states):
            first = int(seq_lens[r] - (qsl[r + 1] - qsl[r]))
            end = min(int(seq_lens[r]), s.num_tokens - 1)   # a position pairs with the token after it
            if end > first:
                rows.append(s)
                start.append(first)
                n.append(end - first)
                feats.append(hidden[int(qsl[r]): int(qsl[r]) + end - first])
        if not rows:
            return
        n_arr = np.array(n, dtype=np.int64)
        input_ids, positions, md = varlen_batch(rows, np.array(start, dtype=np.int64), n_arr, self.block_size,
                                                token_offset=1)
        out = self.head(input_ids, torch.cat(feats), positions, md)
        for s, last, end in zip(rows, md.query_start_loc_np[1:] - 1, md.seq_lens_np):
            if end == s.num_tokens - 1:
                self.last_hidden[s.req_id] = out[int(last)]

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        states = [s for s in states if s.req_id in self.last_hidden and s.num_tokens < self.max_model_len]
        if not states:
            return {}
        budget = [min(self.k, self.max_model_len - s.num_tokens) for s in states]
        h = torch.stack([self.last_hidden[s.req_id] for s in states])
        drafts = [[t] for t in greedy_tokens(self.target.compute_logits(h)).tolist()]
        live = [i for i in range(len(states)) if budget[i] > 1]
        pos = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)   # the pair (draft 1, h) sits here
        while live:
            batch = [states[i] for i in live]
            for i in live:
                states[i].write_drafts(drafts[i])
            input_ids, positions, md = varlen_batch(batch, pos[live], np.ones(len(live), dtype=np.int64),
                                                    self.block_size, token_offset=1)
            h_live = self.head(input_ids, h[live], positions, md)
            h[live] = h_live
            for i, tok in zip(live, greedy_tokens(self.target.compute_logits(h_live)).tolist()):
                drafts[i].append(tok)
            pos[live] += 1
            live = [i for i in live if len(drafts[i]) < budget[i]]
        return {s.req_id: d for s, d in zip(states, drafts)}


def _load_head(m, backend, device: str, max_positions: int, target_embedding: torch.Tensor) -> EagleHead:
    tensors = list(eagle_checkpoint_tensors(m.model))
    fc_bias = any(n.removeprefix("model.") == "fc.bias" for n, _ in tensors)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[m.dtype])
    try:
        with torch.device(device):
            head = EagleHead(m.hf_config, backend, max_positions, fc_bias)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        try:
            head.load_weights(tensors, target_embedding)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {m.model} is not an EAGLE head for this target: {e}") from e
        head.process_weights_after_loading()
    head.eval()
    logger.info("loaded EAGLE head %s: %d layer(s), fc %s bias", m.model, m.num_layers,
                "with" if fc_bias else "without")
    return head
