"""The EAGLE proposer (EAGLE-1 and EAGLE-3 heads): a draft head fed with the target's hidden states
(model/eagle.py has the heads).

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
from tokenmill.layers.attention import allocate_kv_caches
from tokenmill.model.eagle import Eagle3Head, EagleHead, eagle_checkpoint_tensors
from tokenmill.model.loader import DTYPES
from tokenmill.utils import init_logger
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import varlen_batch

logger = init_logger(__name__)


class EagleProposer:
    observes = True
    def __init__(self, config: EngineConfig, backend, device: str, target: torch.nn.Module):
        self.k = config.speculative_config.num_speculative_tokens
        self.model_config = config.draft_model_config
        self.max_model_len = config.scheduler_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.device = device
        self.target = target
        self.head = _load_head(config.speculative_config.method, self.model_config, backend, device,
                               self.max_model_len, target)
        target.model.aux_hidden_state_layers = self.head.aux_layers
        self.last_states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # mirror output at the newest token

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        allocate_kv_caches(self.head.attention_layers(), num_blocks, block_size, DTYPES[self.model_config.dtype],
                           self.device, "EAGLE head KV cache")

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.last_states.pop(rid, None)

    @torch.inference_mode()
    def observe(self, states: list[CachedRequestState], qsl: np.ndarray, seq_lens: np.ndarray,
                hidden: torch.Tensor) -> None:
        """states: every request of the step, with its verified tokens appended; hidden: the target's output for
        the step's tokens (query_start_loc qsl, context seq_lens)."""
        self.last_states.clear()
        feats_all = self.head.features(hidden, self.target.model.aux_hidden_states)
        rows, start, n, feats = [], [], [], []
        for r, s in enumerate(states):
            first = int(seq_lens[r] - (qsl[r + 1] - qsl[r]))
            end = min(int(seq_lens[r]), s.num_tokens - 1)   # a position pairs with the token after it
            if end > first:
                rows.append(s)
                start.append(first)
                n.append(end - first)
                feats.append(feats_all[int(qsl[r]): int(qsl[r]) + end - first])
        if not rows:
            return
        n_arr = np.array(n, dtype=np.int64)
        input_ids, positions, md = varlen_batch(rows, np.array(start, dtype=np.int64), n_arr, self.block_size,
                                                token_offset=1, device=self.device)
        out, next_feats = self.head(input_ids, torch.cat(feats), positions, md)
        for s, last, end in zip(rows, md.query_start_loc_np[1:] - 1, md.seq_lens_np):
            if end == s.num_tokens - 1:
                self.last_states[s.req_id] = (out[int(last)], next_feats[int(last)])

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        states = [s for s in states if s.req_id in self.last_states and s.num_tokens < self.max_model_len]
        if not states:
            return {}
        budget = [min(self.k, self.max_model_len - s.num_tokens) for s in states]
        out = torch.stack([self.last_states[s.req_id][0] for s in states])
        h = torch.stack([self.last_states[s.req_id][1] for s in states])
        drafts = [[t] for t in self.head.draft(out).tolist()]
        live = [i for i in range(len(states)) if budget[i] > 1]
        pos = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)   # the pair (draft 1, h) sits here
        while live:
            batch = [states[i] for i in live]
            for i in live:
                states[i].write_drafts(drafts[i])
            input_ids, positions, md = varlen_batch(batch, pos[live], np.ones(len(live), dtype=np.int64),
                                                    self.block_size, token_offset=1, device=self.device)
            out_live, h_live = self.head(input_ids, h[live], positions, md)
            h[live] = h_live
            for i, tok in zip(live, self.head.draft(out_live).tolist()):
                drafts[i].append(tok)
            pos[live] += 1
            live = [i for i in live if len(drafts[i]) < budget[i]]
        return {s.req_id: d for s, d in zip(states, drafts)}


def _load_head(method: str, m, backend, device: str, max_positions: int,
               target: torch.nn.Module) -> EagleHead | Eagle3Head:
    tensors = list(eagle_checkpoint_tensors(m.model))
    fc_bias = any(n.removeprefix("model.") == "fc.bias" for n, _ in tensors)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[m.dtype])
    try:
        with torch.device(device):
            if method == "eagle3":
                head = Eagle3Head(m.hf_config, backend, max_positions, target.config)
            else:
                head = EagleHead(m.hf_config, backend, max_positions, fc_bias, target.compute_logits)
        with torch.no_grad():
            head.load_weights(tensors, target.model.embed_tokens.weight)
            head.process_weights_after_loading()
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {m.model} is not an {method} head for this target: {e}") from e
    finally:
        torch.set_default_dtype(prev)
    head.eval()
    logger.info("loaded %s head %s: %d layer(s)%s", method, m.model, m.num_layers,
                f", reading target layers {head.aux_layers}" if head.aux_layers else "")
    return head
