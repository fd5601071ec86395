"""`tokenmill serve | complete | chat | bench | router | plan | quantize`."""

from __future__ import annotations

import argparse
import os
import sys

from tokenmill.cli.args import add_engine_args, engine_args_from


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="Seed of this request's sampling.")


def _sampling_params(ns: argparse.Namespace):
    from tokenmill import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          seed=ns.sampling_seed)


def cmd_complete(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    out = llm.generate(ns.prompt, _sampling_params(ns), use_tqdm=False)[0]
    print(ns.prompt + out.outputs[0].text if ns.echo else out.outputs[0].text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    prompts = [ns.message] if ns.message else None
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            text = prompts.pop(0)
        else:
            try:
                text = input("> ")
            except EOFError:
                return 0
        messages.append({"role": "user", "content": text})
        reply = llm.chat(messages, _sampling_params(ns), use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A small, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    from tokenmill.entrypoints.openai.cli_args import add_serve_args

    serve = sub.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_engine_args(serve)
    add_serve_args(serve)

    complete = sub.add_parser("complete", help="Complete one prompt and print the text.")
    complete.add_argument("prompt", help="The prompt text.")
    complete.add_argument("--echo", action="store_true", help="Print the prompt before the completion.")
    add_engine_args(complete, positional_model=False)
    _sampling_args(complete)

    chat = sub.add_parser("chat", help="Chat with the model on the terminal (or answer --message once).")
    chat.add_argument("--system", default=None, help="A system message.")
    chat.add_argument("--message", action="append", help="Send this message instead of reading stdin (repeatable).")
    add_engine_args(chat, positional_model=False)
    _sampling_args(chat)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from tokenmill.router.cli import add_router_parser

    add_router_parser(sub)

    from tokenmill.plan.cli import add_plan_parser

    add_plan_parser(sub)

    from tokenmill.cli.quantize import add_quantize_parser

    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv):
        from tokenmill.engine.process_start import prestart_engine_process

        # before the parser is even built (its modules take ~0.2-0.3 s): the fork server's imports are the
        # longest part of a cold start. The model (a path: a folder's config needs transformers preloaded) is
        # guessed from the arguments; a wrong guess costs only time.
        prestart_engine_process(next((a for a in argv[1:] if not a.startswith("-") and os.path.exists(a)), None))
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0) if hasattr(ns, "func") else _dispatch(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.command == "complete":
        return cmd_complete(ns)
    if ns.command == "chat":
        return cmd_chat(ns)
    if ns.command == "serve":
        from tokenmill.engine.process_start import prestart_engine_process

        prestart_engine_process(ns.model)   # (started already by main(): this call is then a no-op)
        from tokenmill.entrypoints.openai.server import run_server

        return run_server(ns)
    raise SystemExit(f"unknown command {ns.command}")


if __name__ == "__main__":
    sys.exit(main())
