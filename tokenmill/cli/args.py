"""CLI flags generated from EngineArgs, so the command line and `LLM(**kwargs)` never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from tokenmill.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" and positional_model:
            parser.add_argument("model", nargs="?", default=None, help=f.metadata["help"])
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        kw = dict(default=f.default, help=f.metadata["help"], dest=f.name)
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            group.add_argument(flag, type=base, **kw)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
