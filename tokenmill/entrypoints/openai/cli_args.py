"""The server's own flags (the engine's come from EngineArgs)."""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.openai.chat_output import ChatOutputOptions
from tokenmill.structured_output.reasoning import REASONING_PARSERS
from tokenmill.structured_output.tool_parsers import TOOL_PARSERS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 opens it to the network).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="Run N engine cores behind this one API server (vLLM's data parallel), each with its own KV "
                        "cache (--kv-cache-memory is each one's) on its share of the CPUs; a request goes to the "
                        "engine that most likely holds its prefix, else the least loaded.")
    g.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                   help="What the machine costs an hour: each response's usage then carries engine_seconds (its "
                        "share of engine time: per step, its tokens over the step's) and cost_usd; /metrics gets "
                        "tokenmill:request_cost_usd and the periodic log line the cost per million output tokens.")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="Export one OpenTelemetry span per request (queue, prefill, decode and first-token times, "
                        "token counts) over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318/v1/traces "
                        "(needs the [otel] extra).")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, each as name=path or vLLM's JSON {\"name\": ..., "
                        "\"path\": ..., \"base_model_name\": ...}; a request picks one by its model field "
                        "(needs --enable-lora).")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="Answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: they answer 404).")
    g.add_argument("--api-key", default=None, help="Require this bearer key on /v1 routes (or TOKENMILL_API_KEY).")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="Beyond max_num_seqs running, refuse new requests with 503 once this many are waiting.")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="Refuse new requests with 503 once the requests held hold this many prompt tokens.")
    g.add_argument("--max-concurrent-requests-per-key", type=int, default=None,
                   help="Refuse a caller's requests with 429 while its API key has this many in flight.")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="Seconds a request may take (its own `timeout` field overrides); past it, it is aborted "
                        "and answered with a 408 error.")
    g.add_argument("--cache-salt-by-api-key", action="store_true",
                   help="Salt every request's prefix-cache hashes with its bearer key, so tenants never share "
                        "cached blocks (nor learn each other's prompts from timing).")
    g.add_argument("--engine-stall-timeout", type=float, default=30.0,
                   help="/health turns red when the engine makes no step for this long while requests wait (0: off).")
    g.add_argument("--engine-stall-exit-timeout", type=float, default=120.0,
                   help="After this long without progress the server kills the engine and exits non-zero (0: never).")
    lim = p.add_argument_group("input limits (each past its bound: 400 naming the field)")
    lim.add_argument("--max-n", type=int, default=16, help="Largest n (and best_of).")
    lim.add_argument("--max-logprobs", type=int, default=20, help="Largest logprobs / top_logprobs / prompt_logprobs.")
    lim.add_argument("--max-stop-sequences", type=int, default=16, help="Most stop strings.")
    lim.add_argument("--max-stop-length", type=int, default=256, help="Longest stop string, in characters.")
    lim.add_argument("--max-logit-bias", type=int, default=300, help="Most logit_bias entries (and stop_token_ids).")
    lim.add_argument("--max-messages", type=int, default=1024, help="Most chat messages.")
    lim.add_argument("--max-prompts", type=int, default=256, help="Most prompts in one completions request.")
    lim.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="Largest request body (413 past it).")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="On SIGTERM, seconds to let in-flight requests finish before they are aborted.")
    g.add_argument("--uvicorn-log-level", default="warning", help="Log level of uvicorn's own logger.")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let the model decide to call tools (tool_choice \"auto\"); needs --tool-call-parser.")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="How tool calls are read from the text: hermes (<tool_call>{...}</tool_call>, what "
                        "tokenmill's own tool prompt asks for), llama3_json, pythonic.")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="Split <think>...</think> into reasoning_content; output constraints apply after it.")


def chat_output_options(ns: argparse.Namespace) -> ChatOutputOptions:
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    reasoning = REASONING_PARSERS[ns.reasoning_parser] if ns.reasoning_parser else None
    return ChatOutputOptions(ns.enable_auto_tool_choice, ns.tool_call_parser, reasoning)
