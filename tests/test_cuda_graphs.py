"""CUDA graphs of decode steps (worker/cuda_graphs.py) and the Triton backend they need, checked on the CPU: the
Triton kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU) and the graph
calls are replaced by a stand-in that records the forward at capture and re-runs it at each replay, writing into
the captured output as a graph does. A forward that read anything but the static buffers at replay (a host
array, a tensor of the step) would then give wrong tokens here, as it would on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_greedy_matches, hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.engine.create_config import capture_sizes

pytest.importorskip("triton")


class ReplayingGraph:
    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class ReplayingApi:
    """GraphApi's stand-in on the CPU."""

    captures = 0

    def pool(self):
        return None

    def memory(self) -> int:
        return 0

    def capture(self, forward, pool):
        self.captures += 1
        out = forward()
        return ReplayingGraph(forward, out), out


def test_capture_sizes_follow_vllms_defaults_and_the_flag():
    assert capture_sizes(None, 256)[:5] == (1, 2, 4, 8, 16) and capture_sizes(None, 256)[-1] == 256
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16, 20)   # a full batch is captured too
    assert capture_sizes(None, 4096)[-1] == 512
    assert capture_sizes("8, 1,2", 256) == (1, 2, 8)
    assert capture_sizes([1, 300], 256) == (1, 256)
    for bad in ("1,x", "0", ""):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            capture_sizes(bad, 256)


def _greedy(llm, prompts, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_decode_graphs_replay_the_same_tokens_as_transformers(tiny_model_dir):
    """Five requests of different lengths: decode steps of 5, then fewer rows as they finish, replay the sizes
    8, 2 and 1 (padded rows included), and every token equals transformers' (ties detected)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (3, 17, 40, 9, 70)]
    llm = LLM(str(folder), dtype="float32", attention_backend="triton", kv_cache_memory="16MiB", block_size=16,
              cuda_graph_sizes="1,2,8")
    runner = llm.engine_core.executor.runner
    assert runner.graphs is None   # (the CPU: graphs only where asked)
    api = ReplayingApi()
    assert runner.enable_decode_graphs(api)
    n_new = [12, 5, 20, 8, 16]
    outs = []
    for p, n in zip(prompts, n_new):   # one at a time and then together
        outs.append(_greedy(llm, [p], n)[0])
    together = _greedy(llm, prompts, 20)
    assert api.captures == 3 and runner.graphs.replays > 0
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, n, (tokens, logprobs), (all_tokens, all_lps) in zip(prompts, n_new, outs, together):
        ref, ref_logits = hf_greedy(hf, prompt, 20)
        assert_greedy_matches(tokens, logprobs, ref[:n], ref_logits[:n])
        assert_greedy_matches(all_tokens, all_lps, ref, ref_logits)


def test_steps_a_graph_cannot_hold_run_eagerly(tiny_model_dir):
    """A prompt step, and a decode step of more rows than the largest size, take the eager forward."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", attention_backend="triton", kv_cache_memory="16MiB",
              cuda_graph_sizes="2")
    runner = llm.engine_core.executor.runner
    assert runner.enable_decode_graphs(ReplayingApi())
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)], sp, use_tqdm=False)
    assert runner.graphs.replays == 0   # three rows decode: more than the one captured size
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    assert runner.graphs.replays == 3   # the prompt step eager, its three decode steps replayed


def test_an_engine_whose_step_cannot_be_captured_says_why(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", attention_backend="torch_sdpa",
              kv_cache_memory="16MiB")
    runner = llm.engine_core.executor.runner
    assert not runner.enable_decode_graphs(ReplayingApi()) and runner.graphs is None


def test_a_capture_that_fails_leaves_the_engine_eager(tiny_model_dir):
    class FailingApi(ReplayingApi):
        def capture(self, forward, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    folder = str(tiny_model_dir("llama"))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [11, 12, 13, 14]}]
    eager = LLM(folder, dtype="float32", attention_backend="triton", kv_cache_memory="16MiB")
    want = eager.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(folder, dtype="float32", attention_backend="triton", kv_cache_memory="16MiB", cuda_graph_sizes="1")
    runner = llm.engine_core.executor.runner
    assert runner.enable_decode_graphs(FailingApi())
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == want
    assert runner.graphs.replays == 0 and not runner.graphs.takes(_decode_md(), 1)


def _decode_md():
    import numpy as np

    from tokenmill.attention.backend import AttentionMetadata

    one = np.array([0, 1])
    return AttentionMetadata(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                             torch.from_numpy(one), torch.ones(1, dtype=torch.int64), one, np.ones(1, dtype=np.int64),
                             1, 1)


@pytest.mark.parametrize("family, extra", [("mixtral", {}), ("llama", {"kv_cache_dtype": "fp8"})])
def test_steps_that_read_the_host_stay_eager(tiny_model_dir, family, extra):
    """Mixture-of-experts routing, and a quantized cache (attended by torch_sdpa's decode), read host values."""
    llm = LLM(str(tiny_model_dir(family)), dtype="float32", attention_backend="triton", kv_cache_memory="16MiB",
              **extra)
    assert not llm.engine_core.executor.runner.enable_decode_graphs(ReplayingApi())
