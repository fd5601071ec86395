"""The ZMQ KV connector: a prefill instance serves the KV blocks of prompts it computed, a decode instance pulls
them before it schedules a request, and the prefix cache is the seam on both sides.

The producer answers pulls from its prefix cache (the blocks of a finished prompt stay there, findable by their
chained hashes, until a new allocation evicts them); the consumer writes what it receives into fresh blocks,
registers them under the same hashes and frees them, so the scheduler finds the prompt as a cached prefix and
computes only the rest (at least the last prompt token, whose logits it samples from). Anything not received
(blocks evicted meanwhile, a producer that does not answer in time) is simply computed: a transfer changes how
much is recomputed, never what the model says.

Wire (ZMQ over TCP, DEALER -> ROUTER): the pull is one msgpack frame [[hash, token ids], ...] of the blocks
wanted, in order; the answer is a msgpack header {"layout", "num_blocks", "scales", "k_offsets"} and then one
frame per layer holding that layer's K and V of the first num_blocks of them, as stored ([2, n, block_size, Hkv,
D] bytes).
Both ends run in the engine-core process, which owns the KV cache; the producer answers between engine steps,
so no step writes a block while it is copied out.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch
import zmq

from tokenmill.core.block_hash import BlockHash
from tokenmill.core.block_pool import BlockPool
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.layout import kv_layout, layout_mismatch
from tokenmill.utils import init_logger

logger = init_logger(__name__)


def _offset_list(layer) -> list[float] | None:
    return None if layer.k_offset is None else layer.k_offset.flatten().tolist()


# Two instances calibrate K offsets on the same text, so they agree but for rounding where their kernels differ
# (AMX or not); keys centred on offsets this close mix with an error far below the cache's own.
K_OFFSET_TOLERANCE = 1e-2


def _offsets_agree(layer, theirs: list[float] | None) -> bool:
    ours = _offset_list(layer)
    if ours is None or theirs is None:
        return ours is None and theirs is None
    return len(ours) == len(theirs) and max(abs(a - b) for a, b in zip(ours, theirs)) <= K_OFFSET_TOLERANCE


@dataclass
class PulledBlocks:
    """What a producer sent for one request: the header and a frame per layer, and the hashes asked for."""
    header: dict
    frames: list
    wanted: list[BlockHash]


class KVConnector:
    def __init__(self, transfer: KVTransferConfig, config, pool: BlockPool, runner):
        self.transfer = transfer
        self.pool = pool
        self.layout = kv_layout(config)
        self.block_size = config.cache_config.block_size
        self.layers = runner.model.attention_layers()
        # uint8 views of every layer's cache: index_put has no fp8 kernel, and bytes are what travels
        self.caches = [cache.view(torch.uint8) for cache in runner.kv_caches]
        self.quantized = config.cache_config.cache_dtype != "auto"
        self.ctx = zmq.Context.instance()
        self.server = None
        if transfer.is_producer:
            self.server = self.ctx.socket(zmq.ROUTER)
            self.server.setsockopt(zmq.LINGER, 0)
            try:
                self.server.bind(transfer.address)
            except zmq.ZMQError as e:
                raise ValueError(f"kv_transfer_config: cannot listen on {transfer.address} ({e}); choose another "
                                 f"kv_port") from e
            logger.info("KV transfer: serving computed prompt blocks on %s (%s)", transfer.address,
                        ", ".join(f"{k} {v}" for k, v in self.layout.items()))
        if transfer.is_consumer:
            self.pulls = ThreadPoolExecutor(4, thread_name_prefix="kv-pull")
            logger.info("KV transfer: pulls prompt blocks named by a request's kv_transfer_params (timeout %g s)",
                        transfer.timeout)
        self.num_served_blocks = self.num_received_blocks = 0

    # ---- producer ----------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer every pull waiting on the socket (called between engine steps)."""
        if self.server is None:
            return
        while True:
            try:
                ident, payload = self.server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:   # not a two-frame message: nobody of ours sent it
                continue
            try:
                wanted = msgspec.msgpack.decode(payload, type=list[tuple[bytes, list[int]]])
            except msgspec.DecodeError:
                self.server.send_multipart([ident, msgspec.msgpack.encode({"error": "malformed pull"})])
                continue
            ids = []
            for value, tokens in wanted:
                block = self.pool.get_cached_block(BlockHash(value, tuple(tokens)))
                if block is None:
                    break
                ids.append(block.block_id)
            header = {"layout": self.layout, "num_blocks": len(ids),
                      "scales": [(layer.k_scale, layer.v_scale) for layer in self.layers],
                      "k_offsets": [_offset_list(layer) for layer in self.layers]}
            frames = []
            if ids:
                index = torch.tensor(ids, device=self.caches[0].device)
                frames = [cache.index_select(1, index).cpu().numpy() for cache in self.caches]
            self.server.send_multipart([ident, msgspec.msgpack.encode(header), *frames], copy=False)
            self.num_served_blocks += len(ids)

    # ---- consumer ----------------------------------------------------------------------------------------------
    def start_pull(self, block_hashes: list[BlockHash], num_tokens: int, address: str) -> Future | None:
        """Pull the prompt's full blocks that this instance does not hold yet (not the block of its last token,
        which is computed anyway); None when there is nothing to pull."""
        if not self.transfer.is_consumer:
            raise ValueError("kv_transfer_params: this instance was started without a kv_consumer or kv_both "
                             "--kv-transfer-config")
        hashes = block_hashes[:(num_tokens - 1) // self.block_size]
        have = 0
        while have < len(hashes) and self.pool.get_cached_block(hashes[have]) is not None:
            have += 1
        wanted = hashes[have:]   # (a block's hash names its whole prefix: the producer finds it alone)
        if not wanted:
            return None
        return self.pulls.submit(self._fetch, address, wanted)

    def _fetch(self, address: str, wanted: list[BlockHash]) -> PulledBlocks:
        sock = self.ctx.socket(zmq.DEALER)   # one per pull: a late answer can never be read as another's
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(msgspec.msgpack.encode([(h.value, list(h.token_ids)) for h in wanted]))
            if not sock.poll(int(self.transfer.timeout * 1000)):
                raise TimeoutError(f"{address} sent no KV blocks within {self.transfer.timeout:g} s")
            header, *frames = sock.recv_multipart()
        finally:
            sock.close()
        return PulledBlocks(msgspec.msgpack.decode(header), frames, wanted)

    def install(self, pulled: PulledBlocks) -> int:
        """Write pulled blocks into free blocks, registered in the prefix cache under their hashes and freed (so
        the request about to be scheduled finds them). Returns the tokens installed. A layout that differs from
        ours is a ValueError that fails the request: its bytes would be read as something else."""
        header = pulled.header
        if "error" in header:
            raise ValueError(f"kv_transfer: the producer refused the pull: {header['error']}")
        mismatch = layout_mismatch(self.layout, header.get("layout", {}))
        if mismatch:
            raise ValueError(f"kv_transfer: the producer's KV block layout does not match this instance's "
                             f"(theirs vs ours: {mismatch})")
        n = int(header["num_blocks"])
        if self.quantized and n:
            ours = [(layer.k_scale, layer.v_scale) for layer in self.layers]
            if [tuple(s) for s in header["scales"]] != ours:
                raise ValueError("kv_transfer: the producer's quantized KV cache has other scales than this "
                                 "instance's; start both with the same --kv-cache-dtype and without "
                                 "--calculate-kv-scales")
            theirs = header.get("k_offsets") or [None] * len(self.layers)
            if not all(_offsets_agree(layer, offset) for layer, offset in zip(self.layers, theirs)):
                raise ValueError("kv_transfer: the producer's quantized KV cache stores K with other offsets than "
                                 "this instance's (both calibrate them on the same text at start: start both with "
                                 "the same model, dtype and --kv-cache-dtype)")
        # blocks this instance already holds (found again now: the pull ran outside the engine step) stay as they
        # are; only the missing ones are written
        todo = [i for i in range(n) if self.pool.get_cached_block(pulled.wanted[i]) is None]
        if not todo or len(todo) > self.pool.num_free_blocks:
            return 0
        blocks = self.pool.get_new_blocks(len(todo))
        device = self.caches[0].device
        dst = torch.tensor([b.block_id for b in blocks], device=device)
        src = torch.tensor(todo)
        for cache, frame in zip(self.caches, pulled.frames):
            with warnings.catch_warnings():   # the frame is read-only, and only read from
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(frame, dtype=torch.uint8).view(2, n, *cache.shape[2:])
            cache.index_copy_(1, dst, data.index_select(1, src).to(device))
        self.pool.cache_full_blocks(blocks, [pulled.wanted[i] for i in todo], 0, len(todo))
        self.pool.free_blocks(reversed(blocks))   # cached and free: the tail of the queue, evicted last
        self.num_received_blocks += len(todo)
        return len(todo) * self.block_size

    @property
    def socket(self):
        """The producer's socket, for the engine loop to wake on; None for a pure consumer."""
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close(linger=0)
        if self.transfer.is_consumer:
            self.pulls.shutdown(wait=False, cancel_futures=True)
