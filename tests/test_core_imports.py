"""core/ imports no torch, so the scheduler and KV-cache manager stay testable with no model."""

import subprocess
import sys


def test_core_imports_no_torch():
    code = ("import sys; import tokenmill.core.scheduler, tokenmill.core.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_api_server_start_imports_no_torch(embedded_gguf):
    """The API server reads the embedded model's config, loads its tokenizer and builds its app without torch
    (the engine core imports it): importing torch there was 2-3 s of every cold start. Holds on a CPU-only torch
    build with the start cache filled (a CUDA build asks torch for the device)."""
    import pytest

    from tokenmill.platform import _cpu_only_torch

    if not _cpu_only_torch():
        pytest.skip("a CUDA torch build: the device is torch's answer")
    fill = ("from tokenmill.model.gguf_config import gguf_hf_config; from tokenmill.model.tokenizer import "
            f"load_tokenizer; gguf_hf_config({embedded_gguf!r}); load_tokenizer({embedded_gguf!r})")
    subprocess.run([sys.executable, "-c", fill], check=True)
    code = "\n".join([
        "import sys",
        "from tokenmill.cli.args import engine_args_from",
        "from tokenmill.cli.main import build_parser",
        "from tokenmill.engine.async_llm import AsyncLLM",
        "from tokenmill.entrypoints.openai.server import build_app",
        "from tokenmill.metrics import Metrics",
        "from tokenmill.engine.create_config import create_engine_config",
        f"config = create_engine_config(engine_args_from(build_parser().parse_args(['serve', {embedded_gguf!r}])))",
        "engine = AsyncLLM(config)",
        "build_app(engine, Metrics('m'), 'm', None)",
        "text = engine.input_processor.apply_chat_template([{'role': 'user', 'content': 'hi'}])",
        "assert engine.input_processor.process_prompt(text).prompt_token_ids",
        "assert type(config.model_config.hf_config).__name__ == 'PlainConfig'",
        "assert 'torch' not in sys.modules, 'torch was imported'",
    ])
    subprocess.run([sys.executable, "-c", code], check=True)
