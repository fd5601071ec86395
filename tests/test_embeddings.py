"""Embeddings: LLM.embed and /v1/embeddings equal the same pooling of transformers' final hidden states (cosine
>= 0.9999 in fp32), alone and batched with prompts of different lengths, through chunked prefill; generation
and embedding requests share the engine."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _hf_pooled(hf, ids: list[int], pooler: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].float()   # after the final norm, as the engine's
    vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooler]
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    from transformers import AutoModel

    folder = tiny_model_dir("llama")
    return folder, AutoModel.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("pooler", ["last", "mean", "cls"])
def test_embed_equals_transformers_pooling(tiny_llama, pooler):
    folder, hf = tiny_llama
    prompts = _prompts([3, 17, 40, 71])
    # a 24-token budget: the longer prompts arrive in chunks, and four prompts of different lengths share steps
    with LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", pooler=pooler,
             max_num_batched_tokens=24) as llm:
        batched = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                          use_tqdm=False)]
        alone = llm.embed({"prompt_token_ids": prompts[2]}, use_tqdm=False)[0].outputs.embedding
        again = llm.embed({"prompt_token_ids": prompts[2]}, use_tqdm=False)[0].outputs.embedding   # cached blocks
        text = llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=4, temperature=0),
                            use_tqdm=False)[0]
    for ids, emb in zip(prompts, batched):
        ref = _hf_pooled(hf, ids, pooler)
        assert len(emb) == ref.numel()
        assert torch.nn.functional.cosine_similarity(torch.tensor(emb), ref, dim=0) >= 0.9999
    assert torch.allclose(torch.tensor(alone), torch.tensor(batched[2]), atol=1e-5)
    assert torch.allclose(torch.tensor(again), torch.tensor(alone), atol=1e-5)
    assert len(text.outputs[0].token_ids) == 4 and text.embedding is None


def test_embed_needs_a_pooler(smol_llm):
    with pytest.raises(ValueError, match="pooler"):
        smol_llm.embed("hello")
