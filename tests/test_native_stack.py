"""The native decoder stack (model/native_stack.py) against the Python layers it stands in for: in one engine,
the same requests with the stack off and on give the same tokens and bit-identical logprobs (it calls the same
kernels in the same order), and the stack really ran the decode steps; models and modes it cannot take fall back
to the Python layers; --enforce-eager turns it off."""

from __future__ import annotations

import pytest

import tokenmill.kernels as kernels
from tokenmill import LLM, SamplingParams
from tokenmill.model.native_stack import NativeDecoderStack, _kernel_namespace, _stack_class

pytestmark = pytest.mark.skipif(_stack_class(_kernel_namespace()) is None,
                                reason="the native decoder stack needs the AVX-512 BF16 kernels")

# prompts of different lengths (so decode steps mix sequence lengths), one with a repeated pattern for n-gram drafts
PROMPTS = [{"prompt_token_ids": [(97 * i + 13 * j) % 49000 + 10 for j in range(n)]}
           for i, n in enumerate((5, 23, 40))]
PROMPTS.append({"prompt_token_ids": [101, 202, 303, 404] * 6})


def _model(llm: LLM):
    return llm.engine_core.executor.runner.model.model


@pytest.fixture
def stack_calls(monkeypatch):
    """Each call of the stack: True where it ran the step, False where it left it to the Python layers."""
    calls: list[bool] = []
    original = NativeDecoderStack.forward

    def counting(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(NativeDecoderStack, "forward", counting)
    return calls


def _off_then_on(llm: LLM, max_tokens: int = 20, prompts: list[dict] = PROMPTS):
    """The same requests with the stack off, then on: (tokens, logprobs) of each run."""
    model = _model(llm)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    runs = []
    for stack in (None, NativeDecoderStack(model)):
        model.native_stack = stack
        # each run computes its prompts afresh (a run over the first's cached blocks would recompute only their
        # last ones, in steps of another shape)
        assert llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]))
    return runs


@pytest.mark.parametrize("family,kwargs", [
    ("llama", {}),                                   # GQA, untied head, llama3 rope scaling
    ("qwen2", {}),                                   # q/k/v bias, tied head
    ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "int4"}),
    ("llama", {"kv_cache_dtype": "int8"}),           # scales calibrated at the first step, before the stack is built
    ("llama", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}}),
])
def test_stack_matches_python_layers_bit_for_bit(tiny_model_dir, stack_calls, family, kwargs):
    if kwargs.get("quantization") and not kernels.quant_kernels_available():
        pytest.skip("the quantized kernels need AVX-512 VNNI")
    llm = LLM(str(tiny_model_dir(family)), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False,
              **kwargs)
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs   # exact: the same kernels on the same inputs
    assert sum(stack_calls) >= 15, stack_calls   # the decode steps ran natively
    assert not all(stack_calls)                  # the prompt steps did not


@pytest.mark.skipif(not kernels.quant_kernels_available(), reason="the quantized kernels need AVX-512 VNNI")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_batches_past_the_vnni_kernel_match_too(tiny_model_dir, stack_calls, quantization):
    """32 requests at once: their decode steps take the tile matmul over dequantized panels (AMX's, or the
    vectors' without AMX; gated for the MLP)."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False,
              quantization=quantization)
    gate_up = _model(llm).layers[0].mlp.gate_up_proj.kernel
    assert gate_up.gated_on_tiles and gate_up.vnni_max_rows < 32 <= gate_up.max_rows
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 49000 + 10 for j in range(3 + i)]} for i in range(32)]
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm, 8, prompts)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs
    assert sum(stack_calls) >= 7, stack_calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])   # qwen2: q/k/v biases, passed to oneDNN
def test_bf16_batches_past_the_tile_kernels_match_too(tiny_model_dir, stack_calls, family):
    """136 requests at once: past the skinny matmul's 8 rows the stack's bf16 linears take the tile matmul (AMX's
    up to 128 rows, then oneDNN on the prepacked weight; without AMX the vectors' at any size), as the Python
    layers do, so decode steps of any batch are one native call."""
    from tokenmill.layers.packed_weight import AMX_MAX_ROWS

    llm = LLM(str(tiny_model_dir(family)), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False,
              max_num_seqs=256)
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 49000 + 10 for j in range(3 + i % 13)]} for i in range(136)]
    assert len(prompts) > AMX_MAX_ROWS
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm, 4, prompts)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs
    assert sum(stack_calls) >= 3, stack_calls


def test_prompts_and_chunks_run_natively_and_match_too(tiny_model_dir, stack_calls):
    """head_dim 64: prompts attend on the native prompt kernel inside the stack, so every step of these requests
    is one native call, bit for bit the Python layers'; a prompt cut into 64-token chunks too (a chunk after cached
    context reads its keys from a bf16 cache). Over an fp8 cache such chunks decline: Python dequantizes the keys."""
    if kernels.prefill_attention_op() is None:
        pytest.skip("prompts run on the native prompt kernel")
    llm = LLM(str(tiny_model_dir("llama_d64")), dtype="bfloat16", kv_cache_memory="32MiB",
              enable_prefix_caching=False)
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs
    assert all(stack_calls) and len(stack_calls) >= 20, stack_calls
    long_prompt = [{"prompt_token_ids": [(41 * j) % 49000 + 10 for j in range(150)]}]
    for kv_dtype, native in (("auto", [True] * 3), ("fp8", [True, False, False])):
        chunked = LLM(str(tiny_model_dir("llama_d64")), dtype="bfloat16", kv_cache_memory="32MiB",
                      enable_prefix_caching=False, max_num_batched_tokens=64, max_num_seqs=4,
                      kv_cache_dtype=kv_dtype)
        stack_calls.clear()
        (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(chunked, 6, long_prompt)
        assert stack_tokens == eager_tokens
        assert stack_logprobs == eager_logprobs
        # chunks of 64, 64 and 22 tokens, then the decodes
        assert stack_calls == native + [True] * 5, (kv_dtype, stack_calls)


def test_shared_prefix_steps_match_too(tiny_model_dir, stack_calls, monkeypatch):
    """Requests that continue from one cached 272-token prefix: their decode steps attend it once for all rows
    (the cascade: tails by the paged kernel, the prefix by the prompt kernel, merged), in the native loop as in
    the backend's Python path, bit for bit."""
    from tokenmill.attention.cpu import CpuPagedBackend

    if kernels.prefill_attention_op() is None:
        pytest.skip("the cascade's prefix runs on the native prompt kernel")
    prefixes = []
    original = CpuPagedBackend.native_plan

    def recording(self, *args):
        plan = original(self, *args)
        prefixes.append(plan is not None and plan.prefix is not None)
        return plan

    monkeypatch.setattr(CpuPagedBackend, "native_plan", recording)
    llm = LLM(str(tiny_model_dir("llama_d64")), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=True)
    shared = [(37 * j) % 49000 + 10 for j in range(272)]
    prompts = [{"prompt_token_ids": shared + [(53 * i + j) % 49000 + 10 for j in range(2 + i)]} for i in range(10)]
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm, 8, prompts)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs
    assert sum(prefixes) >= 7, prefixes        # the decode steps shared the prefix ...
    assert sum(stack_calls) >= 7, stack_calls  # ... and ran natively


def test_prompt_steps_finish_only_the_sampled_rows(tiny_model_dir, monkeypatch):
    """A prompt step samples at each request's last token only: the stack's last layer runs its o-proj and MLP
    for those rows alone and returns just them, bit for bit what the Python layers give those rows; a step
    where prompt logprobs read every row keeps them all."""
    if kernels.prefill_attention_op() is None:
        pytest.skip("prompts run on the native prompt kernel")
    steps = []   # (tokens, md.output_rows, rows returned) of each native step
    original = NativeDecoderStack.forward

    def recording(self, input_ids, positions, md):
        out = original(self, input_ids, positions, md)
        rows = None if md.output_rows is None else md.output_rows.tolist()
        steps.append((len(input_ids), rows, None if out is None else out.shape[0]))
        return out

    monkeypatch.setattr(NativeDecoderStack, "forward", recording)
    llm = LLM(str(tiny_model_dir("llama_d64")), dtype="bfloat16", kv_cache_memory="32MiB",
              enable_prefix_caching=False)
    steps.clear()   # (the warm-up's)
    (eager_tokens, eager_logprobs), (stack_tokens, stack_logprobs) = _off_then_on(llm)
    assert stack_tokens == eager_tokens
    assert stack_logprobs == eager_logprobs
    lengths = [len(p["prompt_token_ids"]) for p in PROMPTS]
    ends = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
    assert steps[0] == (sum(lengths), ends, len(PROMPTS)), steps[0]
    assert all(rows is None and out == n for n, rows, out in steps[1:])   # decode steps: every row samples

    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    model, runs = _model(llm), []
    for stack in (None, NativeDecoderStack(model)):
        model.native_stack = stack
        steps.clear()
        runs.append([o.prompt_logprobs for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
    assert runs[1] == runs[0]
    assert steps[0] == (sum(lengths), None, sum(lengths)), steps[0]


@pytest.mark.parametrize("family,kwargs", [("qwen3", {}), ("mistral_window", {}), ("llama", {"dtype": "float32"})])
def test_models_it_cannot_take_run_the_python_layers(tiny_model_dir, stack_calls, family, kwargs):
    """q/k norms, sliding windows, fp32 (the torch kernels): the stack declines once and is not asked again."""
    llm = LLM(str(tiny_model_dir(family)), **{"dtype": "bfloat16", "kv_cache_memory": "32MiB", **kwargs})
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert _model(llm).native_stack.unavailable
    assert not any(stack_calls)


def test_enforce_eager_turns_the_stack_off(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    assert _model(LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB", enforce_eager=True)).native_stack is None
    assert _model(LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB")).native_stack is not None
