"""The models a server answers to: its base model and its LoRA adapters (vLLM's /v1/models, --lora-modules and
the runtime load/unload routes). An adapter is checked against the model when it is added, so a request naming
it never fails on a misfit later."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass

from pydantic import BaseModel

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """`--lora-modules` entries: `name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append(LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {value!r} is not a JSON object with \"name\" and \"path\"") from e
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
            modules.append(LoRAModulePath(name, path))
    return modules


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None   # vLLM's field, accepted; the name decides


class ServingModels:
    def __init__(self, base_name: str, engine_config):
        self.base_name = base_name
        self.config = engine_config
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self.created: dict[str, int] = {}

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """ValueError naming what does not fit: LoRA off, a name in use, a folder that is not an adapter of this
        model (rank, target modules, shapes)."""
        from tokenmill.lora.adapter import read_adapter

        lora_config = self.config.lora_config
        if lora_config is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if not name or name == self.base_name or name in self.adapters:
            raise ValueError(f"lora_name {name!r} is already in use" if name else "lora_name must not be empty")
        read_adapter(path, self.config.model_config.hf_config, lora_config.max_lora_rank)
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self.adapters[name] = lora
        self.created[name] = int(time.time())
        return lora

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", "lora_name")
        del self.adapters[name]   # requests already running with it finish with it
        del self.created[name]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None for the base model); 404 for an unknown name."""
        if model is None or model == self.base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return lora

    def cards(self, created: int) -> list[dict]:
        root = self.config.model_config.model
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "tokenmill", "root": root,
                "parent": None, "max_model_len": self.config.scheduler_config.max_model_len}
        return [base] + [{"id": name, "object": "model", "created": self.created[name], "owned_by": "tokenmill",
                          "root": lora.lora_path, "parent": lora.base_model_name or self.base_name}
                         for name, lora in self.adapters.items()]
