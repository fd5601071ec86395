"""How the engine-core process starts. `tokenmill serve` starts a fork server first thing, and it imports the
engine's modules (torch, transformers, the model code: ~4 s here) on the second core while the API server
imports its own and reads the config; the engine core is then forked from it, ready-made, instead of spawning
an interpreter that imports everything again. Elsewhere (offline LLM, tests in-process) it is a plain spawn.
The fork server has imported but never run anything, so forking it is safe (no thread pools to inherit)."""

from __future__ import annotations

import multiprocessing

PRELOAD = ["transformers", "tokenmill.engine.core_client", "tokenmill.engine.engine_core", "tokenmill.executor.uniproc",
           "tokenmill.worker.model_runner"]
_prestarted = False


def prestart_engine_process(model: str | None = None) -> None:
    """Start the fork server now, importing PRELOAD in the background, and for a model folder transformers' Llama
    config class too (its config reaches the engine core as that class; a GGUF model's, the embedded one's
    included, as a plain config that needs none)."""
    global _prestarted
    from multiprocessing import forkserver

    folder = model is not None and not model.endswith(".gguf")
    preload = PRELOAD + (["transformers.models.llama.configuration_llama"] if folder else [])
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()
    _prestarted = True


def engine_process_context():
    return multiprocessing.get_context("forkserver" if _prestarted else "spawn")
