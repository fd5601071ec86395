"""Turns a SchedulerOutput into one forward pass over the flat varlen batch, then samples.

Inputs are built with vectorized numpy (no per-token Python loops); logits are computed only at
`logits_indices`, the last scheduled token of each request whose known tokens are all computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.ops import kv_storage_dtype
from tokenmill.attention.registry import get_backend
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.comm import pp_recv, pp_send
from tokenmill.distributed.parallel_state import get_pp, get_tp
from tokenmill.layers.attention import allocate_kv_caches
from tokenmill.layers.sampler import Sampler, SamplerOutput, gather_logprobs
from tokenmill.model.loader import DTYPES, load_model
from tokenmill.profiling import StepProfile
from tokenmill.spec_decode.rejection_sampler import rejection_sample
from tokenmill.structured_output.manager import GrammarBitmask
from tokenmill.utils import format_bytes, init_logger
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.pooling import pool_outputs
from tokenmill.worker.prompt_logprobs import add_prompt_logprobs, prompt_logprob_rows
from tokenmill.worker.sampling_inputs import sampling_metadata
from tokenmill.worker.varlen_batch import varlen_batch

logger = init_logger(__name__)


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: np.ndarray     # token index of each sampling row (with drafts: one per draft, then the last)
    sampling_rows: list[int]       # batch rows that sample this step
    draft_ids: list[list[int]]     # per sampling row: the drafts verified this step (most often none)
    grammar_bitmask: GrammarBitmask | None = None
    # pipeline parallel: (first token, end token, metadata) of each micro-batch, contiguous runs of requests
    micro_batches: list[tuple[int, int, AttentionMetadata]] | None = None
    inputs_embeds: torch.Tensor | None = None   # a vision model's step that reaches image placeholders


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
        self.proposer = None
        self.lora_manager = None
        self.kv_offload = None   # the offload tier's store (--kv-offload-bytes)
        self.encoder = None      # the encoder stage: worker/encoder_runner.py (vision), cross_attention_runner.py
        self.logits_rules = None   # a model's own decoding rules on the logits (Whisper's: worker/whisper_rules.py)
        self.speculation_enabled = True   # bench spec turns it off to measure the same engine without drafts
        self.graphs = None       # decode steps replayed from CUDA graphs (worker/cuda_graphs.py)
        spec = config.speculative_config
        self.disable_spec_above = spec.disable_by_batch_size if spec is not None else None

    def load_model(self) -> None:
        from tokenmill.spec_decode.factory import make_proposer

        backend = get_backend(self.config.attention_backend, self.device)
        logger.info("attention backend: %s", backend.name)
        self.model = load_model(self.config.model_config, backend, self.device,
                                self.config.scheduler_config.max_model_len)
        self.proposer = make_proposer(self.config, backend, self.device, self.model)
        if self.config.lora_config is not None:
            from tokenmill.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, self.config.lora_config, self.dtype, self.device)
        if self.config.mm_config is not None:
            from tokenmill.worker.encoder_runner import EncoderRunner

            self.encoder = EncoderRunner(self.model, self.device)
        if self.config.cross_config is not None:
            from tokenmill.multimodal.whisper_tokens import whisper_tokens
            from tokenmill.worker.cross_attention_runner import CrossAttentionRunner
            from tokenmill.worker.whisper_rules import WhisperLogitsRules

            m = self.config.model_config
            self.encoder = CrossAttentionRunner(self.model, self.device, self.config.cross_config.num_slots)
            self.logits_rules = WhisperLogitsRules(whisper_tokens(m.tokenizer, m.hf_config), self.device)

    def initialize_kv_cache(self) -> None:
        c = self.config.cache_config
        layers = self.model.attention_layers()
        # +1: block 0 is the null block
        self.kv_caches = allocate_kv_caches(layers, c.num_blocks + 1, c.block_size,
                                            kv_storage_dtype(c.cache_dtype, self.dtype), self.device,
                                            "allocated KV cache")
        quantized = c.cache_dtype != "auto"
        for layer in layers:   # the first step (the warm-up) calibrates a quantized cache's K offsets, maybe scales
            layer.calibrate = quantized or c.calculate_kv_scales
            layer.calibrate_scales = c.calculate_kv_scales
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(c.num_blocks + 1, c.block_size)
        if self.config.cross_config is not None:
            logger.info("allocated cross-attention KV: %s", format_bytes(self.encoder.allocate(self.dtype)))
        if c.offload_blocks:
            from tokenmill.worker.kv_offload_store import KVOffloadStore

            self.kv_offload = KVOffloadStore(self.kv_caches, c.offload_dir)
        if self.device == "cuda" and self.config.cuda_graph_sizes:
            self.enable_decode_graphs()

    def enable_decode_graphs(self, api=None) -> bool:
        """Decode steps replay CUDA graphs from now on, where this engine's step can be captured at all (see
        worker/cuda_graphs.py); `api`: the graph calls (a stand-in on the CPU in tests)."""
        from tokenmill.worker.cuda_graphs import decode_graphs_for

        self.graphs = decode_graphs_for(self, api)
        return self.graphs is not None

    def prefault_kv(self, first_block: int, end_block: int) -> bool:
        """Write zeros (what they hold) over blocks [first_block, end_block) of every layer's cache: the CPU
        cache is a lazily backed mapping, and the first write to a page costs ~0.6 GB/s in a VM guest. The
        caller passes only blocks that have never been handed out."""
        if self.device != "cpu" or not self.kv_caches:
            return False
        for cache in self.kv_caches:
            cache[:, first_block:end_block].zero_()
        return True

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        if self.proposer is not None:
            self.proposer.forget(so.finished_req_ids | so.preempted_req_ids |
                                 {new.req_id for new in so.scheduled_new_reqs})
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = self.generators.get(new.req_id)
            if gen is None and sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
                self.generators[new.req_id] = gen
            self.requests[new.req_id] = CachedRequestState.create(
                new.req_id, new.token_ids, new.num_prompt_tokens, sp, new.block_ids, new.num_computed_tokens, gen)
            self.requests[new.req_id].lora_request = new.lora_request
            self.requests[new.req_id].mm_features = new.mm_features
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.num_kept_block_ids >= 0:
                del state.block_ids[cached.num_kept_block_ids:]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        drafts = so.scheduled_spec_decode_tokens
        for rid, d in drafts.items():
            self.requests[rid].write_drafts(d)
        n = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        input_ids, positions, md = varlen_batch(states, start, n, self.block_size, device=self.device)
        qsl, seq_lens = md.query_start_loc_np, md.seq_lens_np
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sampling_rows = np.nonzero(seq_lens >= num_tokens)[0]
        draft_ids = [drafts.get(req_ids[r], []) for r in sampling_rows] if drafts else [[] for _ in sampling_rows]
        logits_indices = qsl[1:][sampling_rows] - 1
        if drafts:  # a row per draft and one past the last, each scoring the token after it
            counts = np.array([len(d) + 1 for d in draft_ids], dtype=np.int64)
            ends = np.repeat(logits_indices + 1, counts)
            logits_indices = ends - np.concatenate([np.arange(c, 0, -1) for c in counts])
        inp = StepInputs(req_ids, input_ids, positions, md,
                         logits_indices, sampling_rows.tolist(), draft_ids, so.grammar_bitmask)
        if self.encoder is not None:
            self.encoder.prepare_step(inp, states, start, n, qsl)
        if get_pp().size > 1:
            inp.micro_batches = self._micro_batches(states, start, n, qsl, md)
        elif len(logits_indices) < len(input_ids) - 1 and self._only_logits_rows_used(states):
            # (a step where every token samples, as a decode step, has nothing to leave out)
            md.output_rows = torch.from_numpy(logits_indices if len(logits_indices) else
                                              np.array([len(input_ids) - 1])).to(self.device)
        return inp

    def _only_logits_rows_used(self, states: list[CachedRequestState]) -> bool:
        """Whether this step reads final hidden states at its sampling rows only: not where prompt logprobs,
        pooling or a proposer that observes the hidden states (EAGLE) read other rows, nor across ranks."""
        if get_tp().size > 1 or (self.proposer is not None and self.proposer.observes):
            return False
        return not any(s.sampling_params.pooling is not None or
                       (s.sampling_params.prompt_logprobs is not None and not s.prompt_logprobs_sent)
                       for s in states)

    def _micro_batches(self, states, start: np.ndarray, n: np.ndarray, qsl: np.ndarray,
                       md: AttentionMetadata) -> list[tuple[int, int, AttentionMetadata]]:
        """The step's requests cut into up to pipeline-size runs of about equal tokens, so that while a later
        stage runs one, an earlier stage already runs the next (one run: the whole step, nothing to overlap)."""
        parts = min(get_pp().size, len(states))
        if parts == 1:
            return [(0, int(qsl[-1]), md)]
        total = int(qsl[-1])
        cuts = sorted({int(np.searchsorted(qsl[1:], total * k / parts)) + 1 for k in range(1, parts)} - {len(states)})
        bounds = [0, *cuts, len(states)]
        return [(int(qsl[a]), int(qsl[b]), varlen_batch(states[a:b], start[a:b], n[a:b], self.block_size,
                                                        device=self.device)[2])
                for a, b in zip(bounds, bounds[1:])]

    def apply_output(self, out: ModelRunnerOutput) -> None:
        """On a rank that did not sample: the sampled tokens (from the rank that did), so its copy of each
        request's tokens stays the same as the sampler's."""
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            state = self.requests.get(rid)
            if state is not None:
                for tok in toks:
                    state.append_token(tok)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens; None on a rank that does not sample (a pipeline stage before the last,
        or a tensor-parallel rank other than the first), which only takes its part in the collectives."""
        self._update_states(so)
        if so.kv_offload is not None and self.kv_offload is not None:
            with self.profile.phase("kv_offload"):
                self.kv_offload.apply(so.kv_offload)
        encoder_seconds = 0.0
        if self.encoder is not None and self.encoder.has_work(so):
            t0 = time.perf_counter()
            with self.profile.phase("encoder"):
                self.encoder.run(so, self.requests)
            encoder_seconds = time.perf_counter() - t0
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        with self.profile.phase("prepare_inputs"):
            inp = self._prepare_inputs(so)
            if self.lora_manager is not None:
                self.lora_manager.set_step([self.requests[r].lora_request for r in inp.req_ids],
                                           np.diff(inp.attn_metadata.query_start_loc_np))
        self.profile.model_start()
        with self.profile.phase("forward"):
            if inp.inputs_embeds is not None:
                hidden = self.model(inp.input_ids, inp.positions, inp.attn_metadata, inputs_embeds=inp.inputs_embeds)
            elif inp.micro_batches is None:
                hidden = self._forward(inp)
            else:
                hidden = self._pipeline_forward(inp)
            if self.lora_manager is not None:
                self.lora_manager.end_step()
            if hidden is None:
                return None
        out_rows = inp.attn_metadata.output_rows
        if out_rows is not None and hidden.shape[0] == len(out_rows) < len(inp.input_ids):
            inp.logits_indices = np.arange(len(inp.logits_indices))   # hidden holds the sampling rows alone
        if not get_tp().is_first:
            self._follow_logits(inp, hidden)
            return None
        sampled: list[list[int]] = [[] for _ in inp.req_ids]
        result = ModelRunnerOutput(inp.req_ids, sampled, encoder_seconds=encoder_seconds)
        with self.profile.phase("sample"):
            add_prompt_logprobs(self.model, inp, self.requests, hidden, result, self.device)
            pool_outputs(self.model, self.requests, inp.req_ids, inp.attn_metadata, hidden, result)
            if any(inp.draft_ids):
                self._verify(inp, hidden, result)
            elif inp.sampling_rows:
                self._sample(inp, hidden, result)
        if self.proposer is not None and self.speculation_enabled:
            with self.profile.phase("propose"):
                if self.proposer.observes:
                    md = inp.attn_metadata
                    self.proposer.observe([self.requests[r] for r in inp.req_ids], md.query_start_loc_np,
                                          md.seq_lens_np, hidden)
                if inp.sampling_rows:
                    self._propose(inp, result)
        self.profile.model_done()
        return result

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        g, md = self.graphs, inp.attn_metadata
        if g is not None and g.takes(md, len(inp.input_ids)):
            return g.run(inp.input_ids, inp.positions, md)
        return self.model(inp.input_ids, inp.positions, md)

    def _pipeline_forward(self, inp: StepInputs) -> torch.Tensor | None:
        """This stage's layers over each micro-batch in turn: received from the stage before (unless first), sent
        on without waiting (unless last), so the stages overlap. The last stage returns all the hidden states."""
        pp, hidden_size = get_pp(), self.model.config.hidden_size
        outputs, sends = [], []
        for t0, t1, md in inp.micro_batches:
            intermediate = None
            if not pp.is_first:
                with self.profile.phase("pp_recv"):
                    intermediate = tuple(pp_recv([(t1 - t0, hidden_size)] * 2, self.dtype, self.device))
            out = self.model(inp.input_ids[t0:t1], inp.positions[t0:t1], md, intermediate)
            if pp.is_last:
                outputs.append(out)
            else:
                sends.extend(pp_send(list(out)))
        with self.profile.phase("pp_send"):
            for work in sends:
                work.wait()
        return torch.cat(outputs) if pp.is_last and len(outputs) > 1 else (outputs[0] if outputs else None)

    def _on_device(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)   # (on the CPU, the array itself)

    def _sample(self, inp: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        sampled = result.sampled_token_ids
        states = [self.requests[inp.req_ids[r]] for r in inp.sampling_rows]
        logits = self.model.compute_logits(hidden[self._on_device(inp.logits_indices)])
        if self.logits_rules is not None:
            logits = self.logits_rules.apply(logits, states)
        md = sampling_metadata(states, self.device)
        md.token_bitmask = self._bitmask_rows(inp.grammar_bitmask, [(s.req_id, 0) for s in states])
        out = self.sampler(logits, md)
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

    def _verify(self, inp: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Drafts in this step: a logits row per draft and one more per request; the rejection sampler keeps
        what the target would have said."""
        states = [self.requests[inp.req_ids[r]] for r in inp.sampling_rows]
        logits = self.model.compute_logits(hidden[self._on_device(inp.logits_indices)])
        row_states = [s for s, d in zip(states, inp.draft_ids) for _ in range(len(d) + 1)]
        prefixes = [d[:j] for d in inp.draft_ids for j in range(len(d) + 1)]
        md = sampling_metadata(row_states, self.device, prefixes)
        md.token_bitmask = self._bitmask_rows(inp.grammar_bitmask, [(s.req_id, len(p))
                                                                    for s, p in zip(row_states, prefixes)])
        verified = rejection_sample(self.sampler, logits, md, inp.draft_ids, [s.generator for s in states])
        for row, state, toks in zip(inp.sampling_rows, states, verified.token_ids):
            for tok in toks:
                state.append_token(tok)
            result.sampled_token_ids[row] = toks
        if verified.raw_logprobs is not None:
            for state, toks, rows in zip(states, verified.token_ids, verified.rows):
                k = state.sampling_params.logprobs
                if k is not None:
                    out = SamplerOutput(torch.tensor(toks, device=self.device))
                    gather_logprobs(verified.raw_logprobs[rows], out.sampled, k, out)
                    result.logprobs[state.req_id] = (out.logprob_token_ids.tolist(), out.logprobs.tolist(),
                                                     out.sampled_ranks.tolist())

    def _propose(self, inp: StepInputs, result: ModelRunnerOutput) -> None:
        if self.disable_spec_above is not None and len(self.requests) > self.disable_spec_above:
            return
        states = [self.requests[inp.req_ids[r]] for r in inp.sampling_rows]
        result.spec_token_ids = self.proposer.propose(states)

    @staticmethod
    def _bitmask_rows(gb: GrammarBitmask | None, rows: list[tuple[str, int]]):
        """(logits rows, their mask rows) for the constrained rows; rows are (request, draft position)."""
        if gb is None:
            return None
        pairs = [(i, gb.first_row[rid] + pos) for i, (rid, pos) in enumerate(rows) if rid in gb.first_row]
        if not pairs:
            return None
        logit_rows, mask_rows = zip(*pairs)
        return torch.tensor(logit_rows), gb.bitmask[list(mask_rows)]   # (moved to the logits' device where applied)

    def _follow_logits(self, inp: StepInputs, hidden: torch.Tensor) -> None:
        """A tensor-parallel rank that does not sample still computes its vocabulary slice of every logits row
        the first rank asks for, in the same order (they are gathered there)."""
        for _, _, idx, _ in prompt_logprob_rows(inp, self.requests, self.device):
            if idx is not None:
                self.model.compute_logits(hidden[idx])
        if inp.sampling_rows:
            self.model.compute_logits(hidden[self._on_device(inp.logits_indices)])
