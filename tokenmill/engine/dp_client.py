"""`tokenmill serve --data-parallel-size N`: N engine cores behind one API server (vLLM's data parallel).

Each engine core is its own process with its own KV cache, pinned to its share of the CPUs. A request goes to
the engine whose prefix cache most likely holds its first blocks (the router's consistent hashing with bounded
load, on the prompt's token ids), else to the engine with the fewest requests in flight; its outputs come back
from that engine. The front end sees one client: the same calls as a single engine's, outputs from all engines
on one stream, and scheduler gauges summed over the engines.
"""

from __future__ import annotations

import dataclasses

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.request import prefix_salt
from tokenmill.multimodal.inputs import mm_spans
from tokenmill.router.backends import Backend
from tokenmill.router.policy import Router
from tokenmill.utils import init_logger

logger = init_logger(__name__)

AFFINITY_BLOCKS = 4


def engine_configs(config: EngineConfig, n: int) -> list[EngineConfig]:
    """One config per engine core: the same, but each bound to its share of the CPUs (an explicit --cpu-bind list
    is split; none stays unpinned)."""
    from tokenmill.platform import one_cpu_per_core, parse_cpu_list, process_cpus, rank_cpus

    if config.cpu_bind == "none":
        return [config] * n
    cpus = one_cpu_per_core(process_cpus()) if config.cpu_bind == "auto" else parse_cpu_list(config.cpu_bind)
    if len(cpus) < n:
        raise ValueError(f"--data-parallel-size {n} needs at least {n} CPUs for its engines; {len(cpus)} are bound")
    return [dataclasses.replace(config, cpu_bind=",".join(map(str, rank_cpus(cpus, i, n)))) for i in range(n)]


class DataParallelClient:
    def __init__(self, config: EngineConfig, n: int):
        self.config = config
        self.clients = [AsyncMPClient(c) for c in engine_configs(config, n)]
        self.engines = [Backend(f"engine-{i}", healthy=True) for i in range(n)]   # in-flight counts for the policy
        self.router = Router()
        self.owner: dict[str, int] = {}
        self.latest_stats = [None] * n
        self.poller = zmq.asyncio.Poller()
        for c in self.clients:
            self.poller.register(c.output, zmq.POLLIN)

    @property
    def proc(self):
        """The first engine's process (the watchdog kills it when the engines stall: the server then exits)."""
        return self.clients[0].proc

    @property
    def is_alive(self) -> bool:
        return all(c.is_alive for c in self.clients)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        for c in self.clients:
            await c.wait_ready(timeout)

    def _choose(self, req: EngineCoreRequest) -> int:
        bs = self.config.cache_config.block_size
        ids = req.prompt_token_ids[: bs * AFFINITY_BLOCKS]
        hashes: list = []
        extend_block_hashes(hashes, ids, bs, prefix_salt(req.cache_salt, req.lora_request), mm_spans(req.mm_features))
        decision = self.router.choose(self.engines, hashes[-1].value if hashes else None)
        return self.engines.index(decision.backend)

    async def add_request(self, req: EngineCoreRequest) -> None:
        i = self._choose(req)
        self.owner[req.request_id] = i
        self.engines[i].outstanding += 1
        await self.clients[i].add_request(req)

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._release(rid)
            if i is not None:
                by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            await self.clients[i].abort_requests(ids)

    async def request_state(self) -> None:
        for c in self.clients:
            await c.request_state()

    def _release(self, rid: str) -> int | None:
        i = self.owner.pop(rid, None)
        if i is not None:
            self.engines[i].outstanding -= 1
        return i

    async def get_output(self, timeout_ms: int = 1000) -> EngineCoreOutputs | None:
        ready = dict(await self.poller.poll(timeout_ms))
        for i, c in enumerate(self.clients):
            if c.output in ready:
                outputs = await c.get_output(0)
                if outputs is not None:
                    return self._merged(i, outputs)
        return None

    def _merged(self, i: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Requests that ended leave their engine's count; the gauges (running, waiting, KV usage) become those of
        all engines (each engine's latest), the counters stay this message's own."""
        for out in outputs.outputs:
            if out.finished:
                self._release(out.request_id)
        for rid in (*outputs.errors, *outputs.timed_out):
            self._release(rid)
        stats = outputs.scheduler_stats
        if stats is not None:
            self.latest_stats[i] = stats
            known = [s for s in self.latest_stats if s is not None]
            outputs.scheduler_stats = msgspec.structs.replace(
                stats, num_running_reqs=sum(s.num_running_reqs for s in known),
                num_waiting_reqs=sum(s.num_waiting_reqs for s in known),
                kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(self.clients))
        return outputs

    def shutdown(self, timeout: float = 5.0) -> None:
        for c in self.clients:
            c.shutdown(timeout)
