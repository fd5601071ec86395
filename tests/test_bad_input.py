"""Bad input gets a clear ValueError that names the problem."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.model.source import resolve_model


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("/nonexistent/model/folder")


def test_hub_id_not_on_disk_fails_at_once():
    with pytest.raises(ValueError, match="not on disk"):
        resolve_model("some-org/some-model-that-is-not-here")


def test_embedded_default_resolves(embedded_gguf):
    for name in (None, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        src = resolve_model(name)
        assert src.format == "gguf" and src.path == embedded_gguf


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="unknown architecture.*FooForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n=0), "n"), (dict(min_tokens=5, max_tokens=3), "min_tokens"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_and_too_long_prompts(smol_llm):
    with pytest.raises(ValueError, match="empty"):
        smol_llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        smol_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    limit = smol_llm.config.scheduler_config.max_model_len
    with pytest.raises(ValueError, match=rf"{limit + 1}.*max_model_len.*{limit}"):
        smol_llm.generate({"prompt_token_ids": [5] * (limit + 1)}, use_tqdm=False)
    # the engine still serves after refusing
    out = smol_llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument.*max_seqs"):
        LLM(max_seqs=3)
