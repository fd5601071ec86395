"""Greedy output of tokenmill equals transformers token for token (fp32), with logprobs within 1e-4."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_FAMILIES, assert_greedy_matches, hf_greedy

from tokenmill import LLM, SamplingParams

NEW_TOKENS = 32


def _random_prompts(lengths, seed=0, vocab=49152):
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def _run_ours(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_family_matches_transformers(family, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(family)
    prompts = _random_prompts([3, 17, 40, 71])
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", block_size=16)
    ours = _run_ours(llm, prompts)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, (tokens, logprobs) in zip(prompts, ours):
        ref, ref_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


def test_smollm2_gguf_matches_transformers(embedded_gguf, smol_tokenizer, smol_llm):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    texts = ["Once upon a time, in a land far away,", "The capital of France is",
             "Write a short poem about the sea and the sky, with rhymes, in English please:",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"]
    prompts = [smol_tokenizer(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == 4
    ours = _run_ours(smol_llm, prompts)
    path = Path(embedded_gguf)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for prompt, (tokens, logprobs) in zip(prompts, ours):
        ref, ref_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)
