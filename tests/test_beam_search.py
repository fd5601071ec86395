"""Beam search equals transformers' `generate(num_beams=k)` on fp32 tiny models: the same k sequences in the
same order with the same scores, with and without EOS hits, for several prompts in one call."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tokenmill import LLM
from tokenmill.beam_search import BeamSearch, BeamSearchParams

SCORE_ATOL = 1e-4


def hf_beams(model, prompt: list[int], k: int, max_new: int, eos: int | None, length_penalty: float = 1.0):
    out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, max_new_tokens=max_new,
                         do_sample=False, eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
                         early_stopping=False, output_scores=True, return_dict_in_generate=True,
                         temperature=None, top_p=None, top_k=None)
    seqs = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = row[len(prompt):]
        if eos is not None and eos in gen:   # shorter hypotheses are padded after their EOS
            gen = gen[:gen.index(eos) + 1]
        seqs.append((gen, score))
    return seqs


def assert_same_beams(ours, ref):
    """Same sequences, same order, same scores; where two sequences trade places their scores must tie."""
    assert len(ours.sequences) == len(ref)
    for i, (seq, (ref_tokens, ref_score)) in enumerate(zip(ours.sequences, ref)):
        assert abs(seq.score - ref_score) < SCORE_ATOL, f"beam {i}: score {seq.score} vs transformers {ref_score}"
        if seq.output_token_ids != ref_tokens:
            others = [s for t, s in ref if t == seq.output_token_ids]
            assert others and abs(others[0] - ref_score) < SCORE_ATOL, \
                f"beam {i}: {seq.output_token_ids} vs transformers {ref_tokens}, and not a tie"


def prompts(n: int, length: int = 20, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49152) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_beams_match_transformers_without_eos(tiny):
    folder, hf = tiny
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB")
    ps = prompts(3)
    cached = []
    generate = llm.generate

    def counting(*a, **kw):
        outs = generate(*a, **kw)
        cached.extend(o.num_cached_tokens for o in outs)
        return outs

    llm.generate = counting
    outs = llm.beam_search([{"prompt_token_ids": p} for p in ps], BeamSearchParams(beam_width=4, max_tokens=8))
    for p, out in zip(ps, outs):
        assert_same_beams(out, hf_beams(hf, p, 4, 8, eos=None))
        assert all(s.finish_reason == "length" and s.tokens[:len(p)] == p for s in out.sequences)
    # every beam after the first step found its prompt's first block in the cache instead of computing it
    assert sum(c >= 16 for c in cached) >= len(cached) - len(ps)


@pytest.mark.parametrize("beam, position, length_penalty", [(0, 3, 1.0), (0, 3, 0.5), (1, 8, 1.0)])
def test_beams_match_transformers_with_eos_hits(tiny, tmp_path, beam, position, length_penalty):
    """The EOS is a token that the search without one puts at `position` of the beam ranked `beam`, so hypotheses
    end at different lengths and the ranking, the length penalty and the stopping rule all take part."""
    folder, hf = tiny
    p = prompts(1, seed=9)[0]
    free = hf_beams(hf, p, 3, 10, eos=None)
    eos = free[beam][0][position]
    eos_folder = tmp_path / "eos"
    shutil.copytree(folder, eos_folder)
    for name in ("config.json", "generation_config.json"):
        path = eos_folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    ref = hf_beams(hf, p, 3, 10, eos=eos, length_penalty=length_penalty)
    assert any(t[-1] == eos for t, _ in ref), "the EOS was meant to end some hypothesis"
    llm = LLM(str(eos_folder), dtype="float32", kv_cache_memory="32MiB")
    out = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=3, max_tokens=10,
                                                                     length_penalty=length_penalty))[0]
    assert_same_beams(out, ref)
    ended = [s for s in out.sequences if s.finish_reason == "stop"]
    assert ended and all(s.stop_reason == eos and s.output_token_ids[-1] == eos for s in ended)


def test_search_stops_when_no_running_beam_can_win():
    """A fake model whose every continuation but EOS costs -10: once k hypotheses have ended, nothing running can
    beat them and the search stops before max_tokens."""
    eos = 7
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=50), [eos], 1000)
    steps = 0
    while not search.done:
        steps += 1
        search.advance([[(eos, -0.1), (3, -10.0), (4, -10.5), (5, -11.0)] for _ in search.pending()])
    out = search.result()
    assert steps < 5 and all(s.finish_reason == "stop" for s in out.sequences)
    assert [s.output_token_ids for s in out.sequences][0] == [eos]


@pytest.mark.parametrize("bad, field", [(dict(beam_width=0), "beam_width"), (dict(max_tokens=0), "max_tokens"),
                                        (dict(temperature=0.7), "temperature")])
def test_bad_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
