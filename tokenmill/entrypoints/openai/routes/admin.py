"""The models a server answers to: /v1/models, and vLLM's runtime adapter routes POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}, answered only with
--allow-runtime-lora-updating (they change what every client of the server gets)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import now
from tokenmill.entrypoints.openai.routes.state import parts_of
from tokenmill.entrypoints.openai.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()


@router.get("/v1/models")
async def models(raw: Request):
    return {"object": "list", "data": parts_of(raw).ctx.models.cards(now())}


def _updating_allowed(raw: Request) -> None:
    if not parts_of(raw).allow_runtime_lora_updating:
        raise APIError(404, "Loading and unloading LoRA adapters at run time is off: start the server with "
                            "--allow-runtime-lora-updating", "lora_name")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request):
    _updating_allowed(raw)
    models = parts_of(raw).ctx.models
    try:
        models.add(req.lora_name, req.lora_path)
    except ValueError as e:
        raise APIError(400, str(e), "lora_path" if req.lora_name not in models.adapters else "lora_name") from e
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request):
    _updating_allowed(raw)
    parts_of(raw).ctx.models.remove(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
