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
    return _tokens_and_logprobs(_generate(llm, prompts))


def _generate(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _tokens_and_logprobs(outs):
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


def test_smollm2_gguf_matches_transformers(smol_hf, smol_tokenizer, smol_llm):
    texts = ["Once upon a time, in a land far away,", "The capital of France is",
             "Write a short poem about the sea and the sky, with rhymes, in English please:",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"]
    prompts = [smol_tokenizer(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == 4
    ours = _run_ours(smol_llm, prompts)
    for prompt, (tokens, logprobs) in zip(prompts, ours):
        ref, ref_logits = hf_greedy(smol_hf, prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


@pytest.mark.parametrize("backend", ["cpu", "torch_sdpa"])
def test_sliding_window_through_chunks_and_a_cached_prefix(backend, tiny_model_dir):
    """A windowed model (every layer sees its last 12 tokens) stays equal to transformers when prompts arrive in
    chunks of 24 tokens and when a later prompt starts from the cached blocks of an earlier one: the window
    applies to keys read from the cache as much as to the step's own."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("mistral_window")
    base = _random_prompts([70])[0]
    prompts = [base + tail for tail in _random_prompts([5, 30], seed=1)]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", block_size=16, max_num_batched_tokens=24,
              attention_backend=backend)
    ours = _run_ours(llm, [base])
    later = _generate(llm, prompts)
    assert all(o.num_cached_tokens >= 64 for o in later)  # 4 blocks of the first prompt were reused
    ours += _tokens_and_logprobs(later)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, (tokens, logprobs) in zip([base, *prompts], ours):
        ref, ref_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)
