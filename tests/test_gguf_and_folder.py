"""The GGUF and an HF folder saved from it run the same; the chat template renders as transformers does."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def hf_folder_from_gguf(embedded_gguf, smol_hf, tmp_path_factory):
    """transformers dequantizes the GGUF; the weights are saved as a plain safetensors folder."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = Path(embedded_gguf)
    plain = LlamaForCausalLM(copy.deepcopy(smol_hf.config))
    plain.load_state_dict(smol_hf.state_dict())
    plain.config.quantization_config = None
    folder = tmp_path_factory.mktemp("smollm2-hf")
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_gguf_and_saved_folder_give_same_tokens(smol_llm, hf_folder_from_gguf):
    prompts = ["Once upon a time", "List three colours:", "The quick brown fox"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    from_gguf = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, sp, use_tqdm=False)]
    folder_llm = LLM(str(hf_folder_from_gguf), dtype="float32", kv_cache_memory="128MiB")
    assert folder_llm.config.model_config.format == "hf"
    from_folder = [o.outputs[0].token_ids for o in folder_llm.generate(prompts, sp, use_tqdm=False)]
    assert from_gguf == from_folder


def test_chat_template_renders_as_transformers(smol_llm, hf_folder_from_gguf):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]
    reference = AutoTokenizer.from_pretrained(hf_folder_from_gguf)
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = smol_llm.input_processor.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == expected
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in ours and ours.endswith("<|im_start|>assistant\n")
