"""Vision-language models offline: LLaVA's greedy tokens equal transformers' (its own processor and model) for
one image, several images, images of other sizes and aspect ratios, chunks that end inside an image, and after
preemption; the same words about two images never share KV; refused inputs name what was wrong."""

from __future__ import annotations

import pytest
from conftest import assert_greedy_matches
from vision_utils import (
    QUESTION,
    QWEN_QUESTION,
    LlavaReference,
    Qwen2VLReference,
    build_tiny_llava,
    build_tiny_qwen2_vl,
    data_url,
    random_image,
)

from tokenmill import LLM, SamplingParams

TWO = "USER: <image>\nand <image>\nWhat differs?ASSISTANT:"
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smol_tokenizer):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), smol_tokenizer)


@pytest.fixture(scope="module")
def reference(llava_dir):
    return LlavaReference(llava_dir)


def _images():
    return [random_image(60, 80, 1), random_image(90, 56, 2), random_image(56, 56, 3), random_image(200, 31, 4)]


def _check(outputs, cases, reference, max_new_tokens=10):
    for out, (prompt, images) in zip(outputs, cases, strict=True):
        ids, ref, logits = reference.greedy(prompt, images, max_new_tokens)
        assert out.prompt_token_ids == ids   # the placeholder expanded to the processor's count
        c = out.outputs[0]
        assert_greedy_matches(c.token_ids, [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)], ref,
                              logits)


@pytest.mark.parametrize("eager", [False, True], ids=["native", "eager"])
def test_llava_matches_transformers(llava_dir, reference, eager):
    im = _images()
    cases = [(QUESTION, [im[0]]), (QUESTION, [im[1]]), (QUESTION, [im[3]]), (TWO, [im[0], im[2]])]
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="32MiB", enforce_eager=eager)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims if len(ims) > 1 else ims[0]}}
                         for p, ims in cases], GREEDY, use_tqdm=False)
    _check(outs, cases, reference)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids   # the image is read, not ignored


@pytest.mark.parametrize("strategy,layer", [("full", -1), ("default", [-3, -1])])
def test_llava_feature_choices(tmp_path, smol_tokenizer, strategy, layer):
    """The class token kept (one more placeholder), and several tower layers concatenated into the projector."""
    folder = build_tiny_llava(tmp_path / "m", smol_tokenizer, strategy, layer)
    cases = [(QUESTION, [random_image(70, 50, 5)])]
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory="16MiB")
    outs = llm.generate([{"prompt": QUESTION, "multi_modal_data": {"image": cases[0][1]}}], GREEDY, use_tqdm=False)
    _check(outs, cases, LlavaReference(folder))


def test_chunks_cut_inside_images_and_preemption(llava_dir, reference):
    """8-token steps cut every image's 16 placeholders across steps; a KV cache too small for all four prompts
    preempts and resumes some of them (their images are encoded again or found in the encoder cache)."""
    im = _images()
    cases = [(TWO, [im[0], im[1]]), (TWO, [im[2], im[3]]), (QUESTION, [im[1]]), (TWO, [im[3], im[0]])]
    llm = LLM(model=str(llava_dir), dtype="float32", num_gpu_blocks_override=10, block_size=8,
              max_num_batched_tokens=8)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert llm.engine_core.scheduler.num_preemptions > 0
    _check(outs, cases, reference, max_new_tokens=30)


def test_same_words_other_image_shares_no_kv(llava_dir, reference):
    """With prefix caching, two prompts whose token ids are equal (same text, same placeholder count) but whose
    images differ each get their own image's answer: the image's hash is in the blocks' hashes."""
    im = _images()
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="16MiB", block_size=8)
    first = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": im[0]}}, GREEDY, use_tqdm=False)
    second = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": im[1]}}, GREEDY, use_tqdm=False)
    assert first[0].prompt_token_ids == second[0].prompt_token_ids
    _check(first + second, [(QUESTION, [im[0]]), (QUESTION, [im[1]])], reference)
    again = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": im[0]}}, GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens > 0   # the same image's prompt does hit the cache
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    enc = llm.engine_core.scheduler.encoder
    assert (enc.num_encoded, enc.num_hits) == (2, 0)   # the third prompt's image was all in cached blocks


def test_encoder_cache_reuses_an_image(llava_dir):
    """The same picture in two prompts (and twice in one) goes through the vision tower once."""
    im = random_image(64, 64, 9)
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False)
    llm.generate([{"prompt": TWO, "multi_modal_data": {"image": [im, im]}},
                  {"prompt": QUESTION, "multi_modal_data": {"image": im}}], GREEDY, use_tqdm=False)
    enc = llm.engine_core.scheduler.encoder
    assert enc.num_encoded == 1 and enc.num_hits >= 1


def test_chat_parts_equal_generate(llava_dir):
    """LLM.chat with OpenAI image_url parts (a data: URL) gives generate's prompt and tokens."""
    im = random_image(60, 80, 1)
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="16MiB")
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}},
                                                  {"type": "text", "text": "What is in the picture?"}]}],
                    GREEDY, use_tqdm=False)
    gen = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)
    assert chat[0].prompt_token_ids == gen[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == gen[0].outputs[0].token_ids


def test_refused_inputs(llava_dir, smol_llm):
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="16MiB", limit_mm_per_prompt='{"image": 2}',
              max_image_pixels=100 * 100)
    im = random_image(60, 80, 1)
    bad = {
        "placeholder(s)": {"prompt": TWO, "multi_modal_data": {"image": im}},
        "over the limit of 2": {"prompt": "USER: <image><image><image>", "multi_modal_data": {"image": [im] * 3}},
        "--max-image-pixels": {"prompt": QUESTION, "multi_modal_data": {"image": random_image(120, 100, 2)}},
        "must be a PIL image": {"prompt": QUESTION, "multi_modal_data": {"image": b"\x89PNG"}},
        "image input only": {"prompt": QUESTION, "multi_modal_data": {"audio": im}},
    }
    for words, prompt in bad.items():
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not valid base64"):
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
        llm.chat([{"role": "user", "content": [broken]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        smol_llm.generate({"prompt": "hi <image>", "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        smol_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}}]}],
                      GREEDY, use_tqdm=False)
    # the engine is unharmed: a good request still runs
    assert llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smol_tokenizer):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), smol_tokenizer)


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory, smol_tokenizer):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), smol_tokenizer, v25=True)


QWEN_TWO = "<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|><|vision_end|>differ how?"


@pytest.mark.parametrize("family,eager", [("qwen2_vl", False), ("qwen2_vl", True), ("qwen2_5_vl", False)])
def test_qwen2_vl_matches_transformers(request, family, eager):
    """Each image at its own resolution (6 to 40 embeddings here), M-RoPE's (t, h, w) positions in the prompt and
    the delta after it; 8-token steps cut the images, and a small cache preempts. Qwen2.5-VL's windows: 2x2
    merged units, so the larger images span several (and partial ones at their edges)."""
    qwen_dir = request.getfixturevalue("qwen25_dir" if family == "qwen2_5_vl" else "qwen_dir")
    reference = Qwen2VLReference(qwen_dir)
    im = [random_image(60, 90, 1), random_image(200, 120, 2), random_image(56, 230, 3)]
    cases = [(QWEN_QUESTION, [im[0]]), (QWEN_QUESTION, [im[1]]), (QWEN_QUESTION, [im[2]]), (QWEN_TWO, [im[1], im[0]])]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    for kwargs in (dict(kv_cache_memory="16MiB"), dict(num_gpu_blocks_override=12, block_size=8,
                                                         max_num_batched_tokens=8)):
        llm = LLM(model=str(qwen_dir), dtype="float32", enforce_eager=eager, **kwargs)
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases], sp,
                            use_tqdm=False)
        _check(outs, cases, reference, max_new_tokens=12)
    assert llm.engine_core.scheduler.num_preemptions > 0


def test_qwen2_vl_chat_parts_equal_generate(qwen_dir):
    im = random_image(150, 100, 4)
    llm = LLM(model=str(qwen_dir), dtype="float32", kv_cache_memory="16MiB")
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}},
                                                  {"type": "text", "text": "What is in the picture?"}]}],
                    GREEDY, use_tqdm=False, add_generation_prompt=False)
    gen = llm.generate({"prompt": QWEN_QUESTION, "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)
    assert chat[0].prompt_token_ids == gen[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == gen[0].outputs[0].token_ids


def test_mm_processor_kwargs_cap_qwen_images(qwen_dir):
    """--mm-processor-kwargs '{"max_pixels": ...}' resizes Qwen2-VL's images smaller (6 embeddings instead of 28
    for this 200x120 picture), as transformers' processor does with the same setting."""
    im = random_image(200, 120, 2)
    llm = LLM(model=str(qwen_dir), dtype="float32", kv_cache_memory="16MiB",
              mm_processor_kwargs='{"max_pixels": 6272}')
    out = llm.generate({"prompt": QWEN_QUESTION, "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)
    pad = llm.config.model_config.mm_hf_config.image_token_id
    assert out[0].prompt_token_ids.count(pad) == 6
    _check(out, [(QWEN_QUESTION, [im])], Qwen2VLReference(qwen_dir, max_pixels=6272))
    with pytest.raises(ValueError, match="takes no images"):
        LLM(dtype="float32", kv_cache_memory="16MiB", mm_processor_kwargs='{"max_pixels": 6272}')
