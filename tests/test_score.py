"""Scoring: cross-encoders of the Llama family equal transformers' *ForSequenceClassification (the sigmoid of the
last token's logit, as sentence-transformers' CrossEncoder scores a one-label model), and an embedding model scores
by cosine; /v1/score and /v1/rerank in vLLM's and Jina/Cohere's shapes."""

from __future__ import annotations

import pytest
import requests
import torch
from conftest import TINY_BASE
from server_utils import ServerProcess

from tokenmill import LLM
from tokenmill.entrypoints.scoring import score_pairs

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris, on the Seine.",
        "The Eiffel tower"]


def build_cross_encoder(cls_name: str, folder, tokenizer, **extra):
    import transformers

    cfg = getattr(transformers, cls_name)(**{**TINY_BASE, "num_labels": 1, **extra})
    torch.manual_seed(77)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module", params=[("LlamaConfig", {}), ("Qwen2Config", {"use_sliding_window": False})],
                ids=["llama", "qwen2"])
def cross_encoder(request, tmp_path_factory, smol_tokenizer):
    folder = tmp_path_factory.mktemp(f"ce-{request.param[0]}")
    return folder, build_cross_encoder(request.param[0], folder, smol_tokenizer, **request.param[1]), smol_tokenizer


def hf_scores(model, tokenizer, pairs) -> list[float]:
    out = []
    for a, b in pairs:
        ids = torch.tensor([tokenizer(a, b)["input_ids"]])
        with torch.no_grad():
            out.append(torch.sigmoid(model(ids).logits[0, 0]).item())
    return out


def test_cross_encoder_scores_equal_transformers(cross_encoder):
    folder, hf, tok = cross_encoder
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB")
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    ref = hf_scores(hf, tok, [(QUERY, d) for d in DOCS])
    assert ours == pytest.approx(ref, abs=1e-5)
    assert max(ref) - min(ref) > 1e-3, "the random head was meant to tell the documents apart"
    pairwise = [o.outputs.score for o in llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)]
    assert pairwise == pytest.approx(hf_scores(hf, tok, list(zip(DOCS[:2], DOCS[2:]))), abs=1e-5)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.generate("hello", use_tqdm=False)


def test_embedding_model_scores_by_cosine(tiny_model_dir):
    from transformers import AutoModel

    folder = tiny_model_dir("llama")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", pooler="mean")
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS[:2], use_tqdm=False)]
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()

    def mean_embedding(text):
        with torch.no_grad():
            return hf(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0].mean(0)

    ref = [torch.nn.functional.cosine_similarity(mean_embedding(QUERY), mean_embedding(d), dim=0).item()
           for d in DOCS[:2]]
    assert ours == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize("a, b, n", [("q", ["x", "y"], 2), (["q", "r"], ["x", "y"], 2), ("q", "x", 1)])
def test_pairing_follows_vllm(a, b, n):
    assert len(score_pairs(a, b)) == n


@pytest.mark.parametrize("a, b", [(["q", "r"], ["x", "y", "z"]), ([], ["x"]), ("q", [1])])
def test_bad_pairings_are_value_errors(a, b):
    with pytest.raises(ValueError, match="text_1"):
        score_pairs(a, b)


def test_score_and_rerank_routes(tmp_path, smol_tokenizer):
    folder = tmp_path / "ce"
    hf = build_cross_encoder("LlamaConfig", folder, smol_tokenizer)
    ref = hf_scores(hf, smol_tokenizer, [(QUERY, d) for d in DOCS])
    server = ServerProcess(str(folder), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                           "--served-model-name", "ce")
    try:
        r = requests.post(server.url + "/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
        assert [d["score"] for d in body["data"]] == pytest.approx(ref, abs=1e-5)
        assert body["usage"]["prompt_tokens"] > 0
        order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
        for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = requests.post(server.url + route, json={"model": "ce", "query": QUERY, "documents": DOCS,
                                                        "top_n": 3})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == order[:3]
            assert [x["relevance_score"] for x in results] == pytest.approx([ref[i] for i in order[:3]], abs=1e-5)
            assert results[0]["document"]["text"] == DOCS[order[0]]
        for route, body, field in (
                ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
                ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
                ("/v1/completions", {"prompt": "hi"}, "model"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model")):
            r = requests.post(server.url + route, json={"model": "ce", **body})
            assert r.status_code == 400 and field in (r.json()["error"]["param"] or r.json()["error"]["message"]), \
                (route, r.text)
    finally:
        server.stop()
