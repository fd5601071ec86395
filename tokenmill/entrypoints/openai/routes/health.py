"""Probes and gauges: /health, /live, /ready, /load (a router's view of this replica), /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill import __version__
from tokenmill.entrypoints.openai.errors import error_response
from tokenmill.entrypoints.openai.routes.state import parts_of

router = APIRouter()


@router.get("/health")
async def health(raw: Request):
    """Red when the engine process is gone, or when it has made no step for --engine-stall-timeout seconds while
    requests wait on it (a stuck kernel, a deadlock): the process being up is not enough."""
    parts = parts_of(raw)
    engine, liveness = parts.engine, parts.liveness
    if engine.dead or engine.client is None or not engine.client.is_alive:
        return error_response(503, "the engine core is not running")
    stalled = engine.stalled_for()
    if liveness.stall_timeout and stalled > liveness.stall_timeout:
        return error_response(503, f"the engine has made no progress for {stalled:.0f} s with "
                                   f"{engine.num_unfinished} requests pending")
    return Response(status_code=200)


@router.get("/live")
async def live():
    """The process is up and its event loop answers (for an orchestrator's liveness probe)."""
    return Response(status_code=200)


@router.get("/ready")
async def ready(raw: Request):
    """Ready for traffic: model loaded, engine healthy, not draining, and the waiting queue not full."""
    parts = parts_of(raw)
    engine, ctx, stall = parts.engine, parts.ctx, parts.liveness.stall_timeout
    if engine.client is None or engine.dead or ctx.draining or ctx.full or (stall and engine.stalled_for() > stall):
        return error_response(503, "not ready")
    return Response(status_code=200)


@router.get("/load")
async def load(raw: Request):
    """Requests running and waiting in the engine, KV-cache usage, and requests the server holds (including those
    not yet in the engine); with --kv-transfer-config, its role, where it serves KV blocks, and their layout."""
    parts = parts_of(raw)
    engine = parts.engine
    stats = engine.last_scheduler_stats
    out = {"running": stats.num_running_reqs if stats else 0, "waiting": stats.num_waiting_reqs if stats else 0,
           "kv_usage": stats.kv_cache_usage if stats else 0.0, "unfinished": engine.num_unfinished,
           "draining": parts.ctx.draining}
    transfer = engine.config.kv_transfer_config
    if transfer is not None:   # what a disaggregating router pairs instances by
        from tokenmill.kv_transfer.layout import kv_layout

        out["kv_transfer"] = {"role": transfer.kv_role, "address": transfer.address,
                              "layout": kv_layout(engine.config)}
    return out


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/metrics")
async def prometheus_metrics(raw: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    parts = parts_of(raw)
    parts.metrics.record_frontend(parts.engine.output_processor.take_stats())
    return Response(generate_latest(parts.metrics.registry), media_type=CONTENT_TYPE_LATEST)
