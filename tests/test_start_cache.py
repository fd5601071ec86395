"""The start cache gives back what converting the GGUF file gives (tokenizer, config, dequantized weights), is
rebuilt when the file changes, and costs only time when it cannot be written; the KV cache's zero mapping."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.model import start_cache


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_cached_tokenizer_config_and_weights_are_the_files(embedded_gguf, fresh_cache):
    from pathlib import Path

    from transformers import AutoTokenizer

    from tokenmill.model.gguf_config import _build_hf_config, gguf_hf_config, typed_hf_config
    from tokenmill.model.gguf_file import iter_gguf_weights
    from tokenmill.model.tokenizer import load_tokenizer

    p = Path(embedded_gguf)
    direct = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    load_tokenizer.cache_clear()
    load_tokenizer(embedded_gguf)                 # builds the entry
    load_tokenizer.cache_clear()
    cached = load_tokenizer(embedded_gguf)        # reads it
    load_tokenizer.cache_clear()
    assert any("-tokenizer-" in d.name for d in fresh_cache.iterdir())
    texts = ["Hello, world!", "  spaces\tand\nnewlines  ", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert cached(text).input_ids == direct(text).input_ids, text
        assert cached.decode(direct(text).input_ids) == direct.decode(direct(text).input_ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert cached.get_vocab() == direct.get_vocab() and cached.eos_token_id == direct.eos_token_id

    built = _build_hf_config(embedded_gguf)
    gguf_hf_config(embedded_gguf)
    cached_config = gguf_hf_config(embedded_gguf)   # a plain config: every field the model class set, as set
    assert type(cached_config).__name__ == "PlainConfig" != type(built).__name__
    fields = built.to_dict()
    assert {k: getattr(cached_config, k, None) for k in fields} == fields
    assert typed_hf_config(cached_config).to_dict() == fields

    def convert():
        return iter_gguf_weights(embedded_gguf, gguf_hf_config(embedded_gguf))

    first = dict(start_cache.cached_tensors(embedded_gguf, "weights", torch.bfloat16, convert))
    again = dict(start_cache.cached_tensors(embedded_gguf, "weights", torch.bfloat16,
                                            lambda: pytest.fail("converted again")))
    reference = {name: w.to(torch.bfloat16) for name, w in convert()}
    assert first.keys() == again.keys() == reference.keys()
    for name, w in reference.items():
        assert torch.equal(again[name], w), name


def test_plain_config_answers_every_read_as_the_model_class(embedded_gguf, fresh_cache):
    """Every attribute the engine reads from a config (building the ModelConfig and the model) has the same value
    on the start cache's PlainConfig as on transformers' class: recorded, not listed by hand."""
    from tokenmill.attention.registry import get_backend
    from tokenmill.model.gguf_config import _build_hf_config, gguf_hf_config
    from tokenmill.model.model_config import _eos_token_ids, head_dim_of, model_max_len, resolve_dtype
    from tokenmill.model.registry import model_class

    built = _build_hf_config(embedded_gguf)
    reads: set[str] = set()

    class Recording(type(built)):
        def __getattribute__(self, name):
            reads.add(name)
            return super().__getattribute__(name)

    built.__class__ = Recording
    model_max_len(built), head_dim_of(built), resolve_dtype("auto", built, "cpu")
    _eos_token_ids(embedded_gguf, "gguf", built)
    with torch.device("meta"):
        model_class(built)(built, get_backend(None, "cpu"), 64)
    built.__class__ = Recording.__mro__[1]
    gguf_hf_config(embedded_gguf)
    plain = gguf_hf_config(embedded_gguf)
    read = sorted(n for n in reads if not n.startswith("_") and not callable(getattr(built, n, None)))
    assert {"hidden_size", "num_key_value_heads", "rope_parameters", "vocab_size", "eos_token_id"} <= set(read)
    missing = object()
    assert {n: getattr(plain, n, missing) for n in read} == {n: getattr(built, n, missing) for n in read}


def test_an_edited_file_is_converted_afresh(tmp_path, fresh_cache):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"one")
    calls = []

    def build(tmp):
        calls.append(src.read_bytes())
        (tmp / "x").write_bytes(src.read_bytes())

    a = start_cache.cached_folder(str(src), "thing", build)
    assert start_cache.cached_folder(str(src), "thing", build) == a and len(calls) == 1
    src.write_bytes(b"two!")
    os.utime(src, ns=(1, 1))
    b = start_cache.cached_folder(str(src), "thing", build)
    assert b != a and (b / "x").read_bytes() == b"two!" and len(calls) == 2


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker / "cache"))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x")
    assert start_cache.cached_folder(str(src), "thing", lambda tmp: None) is None
    out = list(start_cache.cached_tensors(str(src), "weights", torch.float32,
                                          lambda: iter([("w", torch.ones(2))])))
    assert [n for n, _ in out] == ["w"]
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", "off")
    assert start_cache.cache_root() is None


def test_kv_caches_in_one_zero_mapping_do_not_overlap():
    from tokenmill.layers.attention import _zero_mapped

    shapes = [(2, 5, 16, 3, 64), (2, 5, 16, 1, 32), (2, 5, 16, 3, 64)]
    caches = _zero_mapped(shapes, torch.bfloat16)
    assert [tuple(c.shape) for c in caches] == shapes and all(c.data_ptr() % 64 == 0 for c in caches)
    assert all(not c.any() for c in caches)
    for i, c in enumerate(caches):
        c.fill_(i + 1)
    assert [float(c.float().mean()) for c in caches] == [1.0, 2.0, 3.0]
