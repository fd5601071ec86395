"""`tokenmill router`: flags, the replicas it may start itself, and the process lifetime."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys

from tokenmill.utils import init_logger

logger = init_logger(__name__)


class _BackendAction(argparse.Action):
    """--backend URL appends a backend; a --weight right after it sets that backend's weight."""

    def __call__(self, parser, ns, value, option_string=None):
        backends = list(getattr(ns, "backends", None) or [])
        if option_string == "--weight":
            if not backends:
                parser.error("--weight must follow a --backend")
            backends[-1] = (backends[-1][0], float(value))
        else:
            backends.append((value, 1.0))
        ns.backends = backends


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="An OpenAI-compatible front for many `tokenmill serve` replicas: routes by "
                                      "prefix-cache affinity and load, health-checks, drains for rollouts.")
    p.add_argument("--backend", action=_BackendAction, dest="backends", metavar="URL",
                   help="A replica's base URL, like http://127.0.0.1:8001 (repeat for each).")
    p.add_argument("--weight", action=_BackendAction, dest="backends", metavar="W",
                   help="The share of traffic of the --backend just before it, relative to 1 (0.1: a canary).")
    p.add_argument("--backends-file", default=None,
                   help="A file of 'URL [WEIGHT]' lines, re-read every health interval (edit it to add or remove "
                        "replicas).")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="Disaggregated serving: a prefill instance (`serve --kv-transfer-config` with kv_role "
                        "kv_producer); each prompt is computed there first. Repeat for each; needs --decode.")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="Disaggregated serving: a decode instance (kv_role kv_consumer), which pulls the prompt's KV "
                        "blocks from the prefill instance and generates. Repeat for each.")
    p.add_argument("--replicas", type=int, default=0,
                   help="Start this many `tokenmill serve` replicas on this machine, each pinned to its share of "
                        "the CPUs (data parallel in one command).")
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="Where --replicas run: mp (processes on this machine) or ray (actors that a running Ray "
                        "cluster spreads over its nodes; `ray start --head` first, or set RAY_ADDRESS).")
    p.add_argument("--replica-args", default="",
                   help="Extra `tokenmill serve` flags for the replicas --replicas starts (one quoted string).")
    p.add_argument("--replica-port-base", type=int, default=8100, help="The first replica's port.")
    scale = p.add_argument_group("autoscaling (Ray Serve's names; on when --max-replicas is given)")
    scale.add_argument("--min-replicas", type=int, default=None,
                       help="Fewest replicas to keep (0: scale to zero when idle; requests then wait through a "
                            "cold start). Default 1.")
    scale.add_argument("--max-replicas", type=int, default=None,
                       help="Most replicas to start (on this machine each gets 1/max of the CPUs).")
    scale.add_argument("--initial-replicas", type=int, default=None, help="Replicas at start (default: min).")
    scale.add_argument("--target-ongoing-requests", type=float, default=2.0,
                       help="Requests in flight plus queued per replica that the scaler aims at.")
    scale.add_argument("--upscale-delay", type=float, default=30.0,
                       help="Seconds the load must ask for more replicas before one starts.")
    scale.add_argument("--downscale-delay", type=float, default=600.0,
                       help="Seconds the load must ask for fewer before one drains (and stops).")
    scale.add_argument("--downscale-to-zero-delay", type=float, default=None,
                       help="Seconds idle before the last replica stops (default: --downscale-delay).")
    scale.add_argument("--max-queued-requests", type=int, default=256,
                       help="Requests the router holds while no replica is up; past this, a 503.")
    scale.add_argument("--queue-timeout", type=float, default=120.0,
                       help="Seconds a held request waits for a replica before a 503 with Retry-After.")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 opens it to the network).")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="Require this bearer key on the admin routes (/router/*), or TOKENMILL_API_KEY. Requests to "
                        "/v1 pass their Authorization header on to the replicas, which check it.")
    p.add_argument("--model", default=None,
                   help="The replicas' model, for its tokenizer and chat template: the router hashes each prompt's "
                        "first blocks as the engine does. Default: the embedded SmolLM2.")
    p.add_argument("--block-size", type=int, default=16, help="The replicas' KV block size.")
    p.add_argument("--affinity-blocks", type=int, default=4,
                   help="Leading blocks whose hash picks the replica (0: route by load alone).")
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="A replica takes a prefix's requests while it carries at most this times the mean load.")
    p.add_argument("--health-interval", type=float, default=1.0, help="Seconds between health checks.")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.set_defaults(func=run_router)


def start_replicas(n: int, port_base: int, extra: str) -> tuple[list[subprocess.Popen], list[str]]:
    """N `tokenmill serve` processes on 127.0.0.1, each with a contiguous share of this process's CPUs."""
    from tokenmill.platform import one_cpu_per_core, process_cpus, rank_cpus

    cpus = one_cpu_per_core(process_cpus())
    procs, urls = [], []
    for i in range(n):
        share = rank_cpus(cpus, i, n)
        port = port_base + i
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--cpu-bind", ",".join(map(str, share)), *shlex.split(extra)]
        logger.info("starting replica %d on port %d, CPUs %s", i, port, share)
        procs.append(subprocess.Popen(cmd, env=os.environ.copy()))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def check_pairing_now(backends, pairing: dict) -> None:
    """At start, the prefill and decode instances that already answer must have the right roles and one KV block
    layout: a ValueError naming what differs (the ones still starting are checked when they come up, and kept out
    of rotation if they do not fit)."""
    import json
    import urllib.request

    from tokenmill.router.backends import BackendPool

    checker = BackendPool([], pairing=pairing)
    for b in backends:
        try:
            with urllib.request.urlopen(b.url + "/load", timeout=2) as r:
                b.kv_transfer = json.loads(r.read()).get("kv_transfer")
        except (OSError, ValueError):
            continue
        problem = checker.pairing_problem(b)
        if problem:
            raise ValueError(f"{b.role} instance {b.url}: {problem}")


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.router.app import build_router_app
    from tokenmill.router.backends import BackendPool, parse_backend, read_backends_file
    from tokenmill.router.policy import PrefixKeyer, Router

    backends = [parse_backend(url, w) for url, w in (ns.backends or [])]
    if ns.backends_file:
        backends += read_backends_file(ns.backends_file)
    if ns.replicas < 0:
        raise ValueError(f"--replicas must not be negative, got {ns.replicas}")
    procs: list[subprocess.Popen] = []
    ray_replicas = None
    if ns.replicas and ns.distributed_executor_backend == "ray":
        from tokenmill.router.ray_replicas import RayReplicas

        ray_replicas = RayReplicas(ns.replicas, ns.replica_port_base, shlex.split(ns.replica_args))
        backends += [parse_backend(u) for u in ray_replicas.urls]
    elif ns.replicas:
        procs, urls = start_replicas(ns.replicas, ns.replica_port_base, ns.replica_args)
        backends += [parse_backend(u) for u in urls]
    prefill_pool, pairing = None, {}
    if ns.prefill or ns.decode:
        backends, prefill_pool = _disaggregated_pools(ns, backends, pairing)
    scaling = autoscaling_config(ns)
    if not backends and scaling is None:
        raise ValueError("give at least one --backend, a --backends-file, --replicas N or --max-replicas N")
    keyer = None
    if ns.affinity_blocks > 0:
        from tokenmill.model.source import resolve_model
        from tokenmill.model.tokenizer import load_tokenizer

        keyer = PrefixKeyer(load_tokenizer(resolve_model(ns.model).path), ns.block_size, ns.affinity_blocks)
    pool = BackendPool(backends, ns.health_interval, pairing=pairing)
    scaler = _autoscaler(ns, pool, scaling) if scaling is not None else None
    api_key = ns.api_key or os.environ.get("TOKENMILL_API_KEY")
    app = build_router_app(pool, keyer, Router(ns.load_factor), ns.backends_file, admin_key=api_key,
                           prefill_pool=prefill_pool, scaler=scaler)
    if prefill_pool is not None:
        logger.info("routing on http://%s:%d, disaggregated: prefill on %s, decode on %s", ns.host, ns.port,
                    ", ".join(ns.prefill), ", ".join(ns.decode))
    elif scaler is not None:
        logger.info("routing on http://%s:%d, autoscaling %d..%d replicas (%g ongoing requests each, up after "
                    "%g s, down after %g s, to zero after %g s)", ns.host, ns.port, scaling.min_replicas,
                    scaling.max_replicas, scaling.target_ongoing_requests, scaling.upscale_delay,
                    scaling.downscale_delay, scaling.downscale_to_zero_delay)
    else:
        logger.info("routing on http://%s:%d over %d replica(s): %s", ns.host, ns.port, len(backends),
                    ", ".join(b.url for b in backends))
    # uvicorn re-raises the SIGINT it stopped on; with Python's default handler that is a KeyboardInterrupt
    # traceback out of a clean shutdown
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, access_log=False)
    finally:
        if ray_replicas is not None:
            ray_replicas.stop()
        stop_replicas(procs)
    return 0


def autoscaling_config(ns: argparse.Namespace):
    """The AutoscalingConfig the flags ask for, or None without --min/--max-replicas."""
    from tokenmill.router.scaling_policy import AutoscalingConfig

    if ns.min_replicas is None and ns.max_replicas is None:
        return None
    if ns.replicas or ns.prefill or ns.decode or ns.backends_file:
        raise ValueError("--min-replicas/--max-replicas start their own replicas: use them without --replicas, "
                         "--backends-file, --prefill or --decode")
    low = 1 if ns.min_replicas is None else ns.min_replicas
    return AutoscalingConfig(low, low if ns.max_replicas is None else ns.max_replicas, ns.initial_replicas,
                             ns.target_ongoing_requests, ns.upscale_delay, ns.downscale_delay,
                             ns.downscale_to_zero_delay, max_queued_requests=ns.max_queued_requests,
                             queue_timeout=ns.queue_timeout)


def _autoscaler(ns: argparse.Namespace, pool, config):
    from tokenmill.router.autoscaler import Autoscaler

    if ns.distributed_executor_backend == "ray":
        from tokenmill.router.ray_replicas import RayLauncher

        launcher = RayLauncher(config.max_replicas, ns.replica_port_base, shlex.split(ns.replica_args))
    else:
        from tokenmill.router.launcher import ProcessLauncher

        launcher = ProcessLauncher(config.max_replicas, ns.replica_port_base, ns.replica_args)
    return Autoscaler(pool, launcher, config)


def _disaggregated_pools(ns: argparse.Namespace, backends: list, pairing: dict):
    """--prefill and --decode: the decode instances (the pool requests go to) and the pool of prefill instances,
    checked now to be a matching pair (same model and KV layout; `pairing` keeps what they agreed on)."""
    from tokenmill.router.backends import BackendPool, parse_backend

    if not (ns.prefill and ns.decode) or backends:
        raise ValueError("disaggregated serving takes --prefill URL and --decode URL (each at least once) and no "
                         "--backend, --backends-file or --replicas")
    decodes = [parse_backend(u) for u in ns.decode]
    prefills = [parse_backend(u) for u in ns.prefill]
    for b in decodes:
        b.role = "decode"
    for b in prefills:
        b.role = "prefill"
    check_pairing_now(prefills + decodes, pairing)
    return decodes, BackendPool(prefills, ns.health_interval, pairing=pairing)


def stop_replicas(procs: list[subprocess.Popen], grace: float = 30) -> None:
    """SIGTERM to every replica process (each drains its in-flight requests, then exits 0), then waits; kills
    what has not exited after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
