"""How the engine-core process starts. `tokenmill serve` starts a fork server first thing, and it imports the
engine's modules (torch and the model code: ~2-3 s here) on the second core while the API server imports its
own (no torch) and reads the config; the engine core is then forked from it, ready-made, instead of spawning
an interpreter that imports everything again. Elsewhere (offline LLM, tests in-process) it is a plain spawn.
The fork server has imported but never run anything, so forking it is safe (no thread pools to inherit)."""

from __future__ import annotations

import multiprocessing

PRELOAD = ["tokenmill.engine.core_client", "tokenmill.engine.engine_core", "tokenmill.executor.uniproc",
           "tokenmill.worker.model_runner"]
_prestarted = False


def prestart_engine_process(model: str | None = None) -> None:
    """Start the fork server now, importing PRELOAD in the background, and for a model folder transformers and
    its Llama config class too (its config reaches the engine core as that class; a GGUF model's, the embedded
    one's included, as a PlainConfig: the engine core then never imports transformers on its way to ready)."""
    global _prestarted
    from multiprocessing import forkserver

    if _prestarted:
        return

    folder = model is not None and not model.endswith(".gguf")
    preload = (["transformers", "transformers.models.llama.configuration_llama"] if folder else []) + PRELOAD
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()
    _prestarted = True


def engine_process_context():
    return multiprocessing.get_context("forkserver" if _prestarted else "spawn")
