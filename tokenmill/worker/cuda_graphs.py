"""Decode steps replayed from CUDA graphs: on a GPU, a small model's decode step is bound by the ~1,000 kernel
launches of its eager forward, not by the GPU. Each capture size (the batch sizes of --cuda-graph-sizes) is
recorded once over static input buffers; a decode step of n rows copies its inputs into the first n rows of the
smallest size that holds them, pads the rest (a padded row writes its K/V to the null block's first slot and
attends that one key) and replays. Prompt steps, and steps the graphs cannot hold, run eagerly.

What can be captured is the model's forward over a step of one token a row, with an attention backend that reads
only device tensors (attention/triton_backend.py). The torch.cuda calls sit behind GraphApi, so the test suite
checks the capture and replay logic on the CPU with a stand-in that records and re-runs the forward.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.utils import format_bytes, init_logger

logger = init_logger(__name__)


def why_not_capturable(runner) -> str | None:
    """Why this engine's decode step cannot be captured (None: it can). A graph holds one forward with its
    kernels' arguments fixed: collectives across ranks, adapters chosen per step, an encoder's inputs, EAGLE's
    hidden-state taps and an attention backend that reads host arrays each step are all outside it."""
    from tokenmill.distributed.parallel_state import get_pp, get_tp

    layers = runner.model.attention_layers()
    backend = layers[0].backend.name if layers else None
    if backend != "triton":
        return f"the {backend} attention backend reads the host each step; the triton one does not"
    if runner.config.cache_config.cache_dtype != "auto":
        return "a quantized KV cache is attended by torch_sdpa's decode, which reads the host each step"
    if get_tp().size > 1 or get_pp().size > 1:
        return "tensor or pipeline parallel"
    if runner.lora_manager is not None:
        return "LoRA adapters"
    if runner.encoder is not None:
        return "an encoder stage"
    if runner.proposer is not None and runner.proposer.observes:
        return "a proposer that reads the target's hidden states"
    from tokenmill.model.moe import SparseMoeBlock

    if any(isinstance(m, SparseMoeBlock) for m in runner.model.modules()):
        return "mixture-of-experts layers group their tokens by expert on the host"
    return None


def decode_graphs_for(runner, api: GraphApi | None = None) -> DecodeGraphs | None:
    """The runner's decode graphs (captured at its first decode step: after the warm-up's prompt, so a quantized
    cache's calibration runs eagerly), or None, with a log line saying why, where its step cannot be captured."""
    reason = why_not_capturable(runner)
    if reason is not None:
        logger.info("CUDA graphs: off (%s); every step runs eagerly", reason)
        return None
    max_blocks = -(-runner.config.scheduler_config.max_model_len // runner.block_size)
    return DecodeGraphs(runner.model, runner.config.cuda_graph_sizes, max_blocks, runner.block_size, runner.device,
                        api)


class GraphApi:
    """The torch.cuda calls of a capture and a replay."""

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        """Runs forward once on a side stream (lazy initialisation must not be captured), then records it;
        returns the graph and the output tensor its replays write."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph, out

    def memory(self) -> int:
        return torch.cuda.memory_reserved()


@dataclass
class CapturedStep:
    size: int
    graph: Any               # what GraphApi.capture returned: replay() runs the recorded forward
    hidden: torch.Tensor     # [size, hidden]: where each replay leaves the final hidden states


class DecodeGraphs:
    """The captured decode steps of one model and its static inputs (the rows of the largest size; each size
    reads its first rows)."""

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...], max_blocks: int, block_size: int,
                 device: str, api: GraphApi | None = None):
        self.model, self.sizes, self.block_size = model, sizes, block_size
        self.api = api or GraphApi()
        self.max_size, self.max_blocks = sizes[-1], max_blocks
        m = self.max_size
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(m, dtype=torch.int64, device=device)   # 0: the null block's first slot
        self.block_table = torch.zeros(m, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(m, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int64, device=device)
        self.steps: list[CapturedStep] = []
        self.replays = 0
        self.layers = model.attention_layers()
        self.calibrated = False   # (a quantized cache calibrates in its first steps, which read values on the host)

    def takes(self, md: AttentionMetadata, rows: int) -> bool:
        """Whether this step can replay a graph: one token a row, no more rows or blocks than were captured, and
        nothing a graph cannot carry (a cross-attention slot, a cut of the output rows)."""
        if not self.calibrated:
            self.calibrated = not any(layer.calibrate for layer in self.layers)
        return (self.calibrated and md.max_query_len == 1 and rows <= self.max_size
                and md.block_table.shape[1] <= self.max_blocks and md.cross_slots is None and md.output_rows is None)

    def capture(self) -> None:
        t0, before = time.perf_counter(), self.api.memory()
        pool = self.api.pool()
        for size in reversed(self.sizes):   # the largest first: the smaller ones reuse its memory pool
            graph, hidden = self.api.capture(self._forward_of(size), pool)
            self.steps.append(CapturedStep(size, graph, hidden))
        self.steps.reverse()
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (%d..%d) in %.2f s, %s",
                    len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - t0,
                    format_bytes(self.api.memory() - before))

    def _forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_table=self.block_table[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            query_start_loc_np=np.arange(size + 1, dtype=np.int64), seq_lens_np=np.ones(size, dtype=np.int64),
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size)
        ids, pos = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(ids, pos, md)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states ([rows, hidden], a tensor of its own), from the smallest captured size
        that holds its rows (captured on the first call)."""
        if not self.steps:
            try:
                self.capture()
            except RuntimeError as e:   # a forward that reads the device on the host cannot be captured
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
                self.max_size = 0   # (takes() refuses every step from now on)
                return self.model(input_ids, positions, md)
        n, width = len(input_ids), md.block_table.shape[1]
        step = self.steps[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.block_table[:n, :width].copy_(md.block_table)
        if step.size > n:   # the padding rows: token 0 at position 0, one key, in the null block
            for t in (self.input_ids, self.positions, self.slot_mapping, self.block_table[:, 0]):
                t[n:step.size].zero_()
            self.seq_lens[n:step.size].fill_(1)
        step.graph.replay()
        self.replays += 1
        return step.hidden[:n].clone()   # (the next replay overwrites the graph's own output)
