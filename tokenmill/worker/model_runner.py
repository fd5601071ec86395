"""Turns a SchedulerOutput into one forward pass over the flat varlen batch, then samples.

Inputs are built with vectorized numpy (no per-token Python loops); logits are computed only at
`logits_indices`, the last scheduled token of each request whose known tokens are all computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.ops import kv_storage_dtype
from tokenmill.attention.registry import get_backend
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from tokenmill.model.loader import DTYPES, load_model
from tokenmill.profiling import StepProfile
from tokenmill.utils import format_bytes, init_logger
from tokenmill.worker.input_batch import CachedRequestState

logger = init_logger(__name__)


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: np.ndarray     # token index of each sampling row
    sampling_rows: list[int]       # batch rows that sample this step


class ModelRunner:
    def __init__(self, config: EngineConfig, device: str = "cpu"):
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.dtype = DTYPES[config.model_config.dtype]
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # outlive preemption, so seeded streams continue
        default_gen = torch.Generator(device=device)
        default_gen.manual_seed(config.seed)
        self.sampler = Sampler(default_gen)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.profile = StepProfile()

    def load_model(self) -> None:
        backend = get_backend(self.config.attention_backend, self.device)
        logger.info("attention backend: %s", backend.name)
        self.model = load_model(self.config.model_config, backend, self.device,
                                self.config.scheduler_config.max_model_len)

    def initialize_kv_cache(self) -> None:
        m, c = self.config.model_config, self.config.cache_config
        shape = (2, c.num_blocks + 1, c.block_size, m.num_kv_heads, m.head_dim)  # +1: block 0 is the null block
        dtype = kv_storage_dtype(c.cache_dtype, self.dtype)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(m.num_layers)]
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches):
            layer.kv_cache = cache
            layer.calibrate = c.calculate_kv_scales
        total = sum(t.numel() * t.element_size() for t in self.kv_caches)
        logger.info("allocated KV cache: %d layers x %s %s = %s", m.num_layers, tuple(shape), str(dtype).split(".")[-1],
                    format_bytes(total))

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = self.generators.get(new.req_id)
            if gen is None and sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
                self.generators[new.req_id] = gen
            self.requests[new.req_id] = CachedRequestState.create(
                new.req_id, new.token_ids, new.num_prompt_tokens, sp, new.block_ids, new.num_computed_tokens, gen)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        n = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        req_idx = np.repeat(np.arange(len(req_ids)), n)
        positions = start[req_idx] + np.arange(total) - qsl[req_idx]
        input_ids = np.concatenate([s.token_buf[b: b + k] for s, b, k in zip(states, start, n)])
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
        for i, s in enumerate(states):
            block_table[i, : len(s.block_ids)] = s.block_ids
        bs = self.block_size
        slot_mapping = block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start + n
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sampling_rows = np.nonzero(seq_lens >= num_tokens)[0]
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping), block_table=torch.from_numpy(block_table),
            query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
            query_start_loc_np=qsl, seq_lens_np=seq_lens, max_query_len=int(n.max()), max_seq_len=int(seq_lens.max()))
        return StepInputs(req_ids, torch.from_numpy(input_ids), torch.from_numpy(positions), md,
                          qsl[1:][sampling_rows] - 1, sampling_rows.tolist())

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        with self.profile.phase("prepare_inputs"):
            inp = self._prepare_inputs(so)
        with self.profile.phase("forward"):
            hidden = self.model(inp.input_ids, inp.positions, inp.attn_metadata)
        sampled: list[list[int]] = [[] for _ in inp.req_ids]
        result = ModelRunnerOutput(inp.req_ids, sampled)
        with self.profile.phase("sample"):
            self._prompt_logprobs(inp, hidden, result)
            if inp.sampling_rows:
                self._sample(inp, hidden, result)
        return result

    def _sample(self, inp: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        sampled = result.sampled_token_ids
        states = [self.requests[inp.req_ids[r]] for r in inp.sampling_rows]
        logits = self.model.compute_logits(hidden[torch.from_numpy(inp.logits_indices)])
        out = self.sampler(logits, self._sampling_metadata(states))
        token_ids = out.sampled.tolist()
        for row, state, tok in zip(inp.sampling_rows, states, token_ids):
            state.append_token(tok)
            sampled[row] = [tok]
        if out.logprobs is not None:
            ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for i, state in enumerate(states):
                k = state.sampling_params.logprobs
                if k is not None:
                    result.logprobs[state.req_id] = ([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]])

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        sps = [s.sampling_params for s in states]
        temperature = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32)
        all_greedy = all(sp.greedy for sp in sps)
        md = SamplingMetadata(temperature=temperature, all_greedy=all_greedy)
        if not all_greedy:
            if any(sp.top_k > 0 for sp in sps):
                md.top_k = torch.tensor([sp.top_k for sp in sps], dtype=torch.int64)
            if any(sp.top_p < 1.0 for sp in sps):
                md.top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32)
            if any(sp.min_p > 0.0 for sp in sps):
                md.min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32)
            md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        wanted = [sp.logprobs for sp in sps if sp.logprobs is not None]
        md.max_num_logprobs = max(wanted) if wanted else None
        if any(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 for sp in sps):
            md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32)
            md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32)
            md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32)
            md.prompt_token_ids = [s.token_buf[: s.num_prompt_tokens].tolist() for s in states]
            md.output_token_ids = [s.output_token_ids for s in states]
        if any(sp.logit_bias for sp in sps):
            md.logit_bias = [sp.logit_bias for sp in sps]
        under_min = [(i, sorted(sp.all_stop_token_ids)) for i, (s, sp) in enumerate(zip(states, sps))
                     if sp.min_tokens and s.num_tokens - s.num_prompt_tokens < sp.min_tokens and sp.all_stop_token_ids]
        md.stop_token_mask = under_min or None
        return md

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """For requests that asked for prompt logprobs: each scheduled prompt position scores the next prompt
        token. Position 0 has no logprob; the output side adds that None."""
        qsl, seq_lens = inp.attn_metadata.query_start_loc_np, inp.attn_metadata.seq_lens_np
        for row, rid in enumerate(inp.req_ids):
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            if k is None or state.prompt_logprobs_sent:
                continue
            first_pos = int(seq_lens[row] - (qsl[row + 1] - qsl[row]))
            last_pos = min(int(seq_lens[row]), state.num_prompt_tokens - 1)   # positions scoring a prompt token
            if last_pos <= first_pos:
                state.prompt_logprobs_sent = True
                result.prompt_logprobs[rid] = ([], [], [])
                continue
            idx = torch.arange(int(qsl[row]), int(qsl[row]) + last_pos - first_pos)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            targets = torch.from_numpy(state.token_buf[first_pos + 1: last_pos + 1].copy())
            out = SamplerOutput(targets)
            gather_logprobs(logprobs, targets, k, out)
            result.prompt_logprobs[rid] = (out.logprob_token_ids.tolist(), out.logprobs.tolist(),
                                           out.sampled_ranks.tolist())
            if last_pos >= state.num_prompt_tokens - 1:
                state.prompt_logprobs_sent = True
