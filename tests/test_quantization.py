"""Weight quantization: the quantizers' error bounds, GGUF blocks read value for value, the native kernels against
their dequantized reference, end-to-end greedy output against transformers with quantized-then-dequantized
weights, and clear errors for bad settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_greedy_matches, hf_greedy

import tokenmill.kernels as kernels
from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant import get_quant_method, quantize_int4, quantize_int8
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.tensor import QuantizedWeight, concat_rows
from tokenmill.model.gguf_blocks import read_blocks

needs_kernels = pytest.mark.skipif(not kernels.quant_kernels_available(),
                                   reason="the quantized kernels need AVX-512 VNNI and a compiler")
needs_amx = pytest.mark.skipif(not (kernels.quant_kernels_available() and kernels.amx_available()),
                               reason="the quantized AMX matmul needs AMX (and the VNNI kernels beside it)")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.01


# ---- the quantizers --------------------------------------------------------------------------------------------

def test_int8_per_channel_error_is_half_a_step():
    w = _weight(48, 96)
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (48, 1) and qw.group == 96 and qw.min is None
    assert int(qw.q.abs().max()) <= 127
    err = (qw.dequantize() - w).abs()
    assert (err <= qw.scale * 0.5 + 1e-7).all()
    assert torch.equal(qw.scale, qw.scale.half().float())  # the kernels' fp16 scale is the one used


@pytest.mark.parametrize("group", [32, 64])
def test_int4_groups_error_is_half_a_step(group):
    w = _weight(32, 128, seed=1)
    qw = quantize_int4(w, group)
    assert qw.scale.shape == (32, 128 // group) and int(qw.q.min()) >= 0 and int(qw.q.max()) <= 15
    step = qw.scale.repeat_interleave(group, dim=1)
    err = (qw.dequantize() - w).abs()
    # half a step, plus the rounding of the minimum to fp16
    assert (err <= step * 0.5 + qw.min.abs().repeat_interleave(group, dim=1) * 2**-11 + 1e-7).all()


def test_int4_group_must_divide_the_input():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(_weight(16, 96), 64)


def test_fused_projections_must_be_quantized_alike():
    a, b = quantize_int8(_weight(16, 64)), quantize_int4(_weight(16, 64), 32)
    with pytest.raises(ValueError, match="quantized differently"):
        concat_rows([a, b])
    both = concat_rows([a, quantize_int8(_weight(32, 64, seed=3))])
    assert both.shape == (48, 64)


# ---- GGUF blocks -----------------------------------------------------------------------------------------------

def test_gguf_blocks_of_the_embedded_file_are_read_value_for_value(embedded_gguf):
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(embedded_gguf)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("Q4_1", "Q8_0") and kind not in seen:
            seen.add(kind)
            shape = (int(t.shape[1]), int(t.shape[0]))
            ours = read_blocks(t.data, kind, shape).dequantize()
            ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert torch.equal(ours, ref), kind
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_from_the_gguf_quantizer(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = _weight(8, 64, seed=4).numpy()
    qtype = GGMLQuantizationType[kind]
    raw = quantize(w, qtype)
    ours = read_blocks(raw, kind, w.shape).dequantize()
    assert torch.equal(ours, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32)))


def test_gguf_block_type_without_a_kernel_is_refused():
    with pytest.raises(ValueError, match="Q4_K has no kernel"):
        read_blocks(np.zeros((1, 144), dtype=np.uint8), "Q4_K", (1, 256))


# ---- the kernels against their reference ------------------------------------------------------------------------

def _exact_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows that int8 quantization per 32 inputs represents exactly: integers in [-127, 127] with one
    +-127 in each block, times a power of two per block. The kernel must then match fp32 up to bf16 output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g)
    q[:, :, 0] = 127 * torch.where(torch.rand(m, k // 32, generator=g) < 0.5, 1, -1)
    scale = 2.0 ** torch.randint(-9, -4, (m, k // 32, 1), generator=g)
    return (q * scale).view(m, k).bfloat16()


CASES = [(8, None), (4, 32), (4, 64)]


def _vnni(kernel: QuantLinearKernel, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemm(x, kernel.q, kernel.scale, kernel.min, kernel.bias_f32, kernel.bits,
                                          kernel.group, kernel.out_features)


def _tiles(kernel: QuantLinearKernel, x: torch.Tensor, gated: bool = False, op: str | None = None) -> torch.Tensor:
    """The tile matmul over dequantized panels: `op` by name, or the one this CPU's layers run."""
    gemm = getattr(torch.ops.tokenmill, op) if op else kernel.tile_gemm
    return gemm(x, kernel.q, kernel.scale, kernel.min, kernel.bias_f32, kernel.bits, kernel.group,
                kernel.out_features, gated)


@needs_kernels
@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 37])
def test_quant_gemm_matches_the_dequantized_weight(bits, group, rows):
    n, k = 80, 192
    w = _weight(n, k, seed=rows)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group)
    bias = torch.randn(n).bfloat16()
    kernel = QuantLinearKernel(qw, bias, torch.bfloat16)
    assert kernel.native
    x = _exact_rows(rows, k, seed=rows)
    ref = x.float() @ qw.dequantize().T + bias.float()
    out = _vnni(kernel, x).float()
    torch.testing.assert_close(out, ref, rtol=2**-8, atol=1e-5)  # bf16 output rounding only


@needs_kernels
@pytest.mark.parametrize("op", ["quant_amx_gemm", "quant_vec_gemm"])
@pytest.mark.parametrize("bits,group", CASES + [(8, 32)])
@pytest.mark.parametrize("rows", [9, 17, 40, 100, 1000])
def test_quant_tile_gemm_matches_the_dequantized_weight(op, bits, group, rows):
    """The tile matmul over dequantized panels, on AMX or on vectors. Per-channel int8 multiplies its integers
    exactly and scales the fp32 sums: bf16 output rounding only. Groups (int4, GGUF's Q8_0-like 8 bits in 32s)
    multiply the weights rounded to bf16, as the dequantized path. 1,000 rows take the vector matmul several
    passes over the weights."""
    if op == "quant_amx_gemm" and not kernels.amx_available():
        pytest.skip("the quantized AMX matmul needs AMX")
    n, k = 96, 576
    w = _weight(n, k, seed=rows)
    qw = quantize_int8(w) if group is None else quantize_int4(w, group) if bits == 4 else None
    if qw is None:   # 8 bits in groups: int8 per channel of each 32-input slice, the layout of GGUF's Q8_0
        parts = [quantize_int8(w[:, i:i + 32]) for i in range(0, k, 32)]
        q = torch.cat([p.q for p in parts], dim=1)
        scale = torch.cat([p.scale for p in parts], dim=1)
        qw = QuantizedWeight(q=q, scale=scale, min=None, bits=8, group=32)
    bias = torch.randn(n).bfloat16()
    kernel = QuantLinearKernel(qw, bias, torch.bfloat16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = bits == 8 and group is None
    weight = qw.dequantize() if exact else qw.dequantize().bfloat16().float()
    ref = x.float() @ weight.T + bias.float()
    torch.testing.assert_close(_tiles(kernel, x, op=op).float(), ref, rtol=2**-8, atol=1e-4)
    gated = _tiles(kernel, x, gated=True, op=op)   # gate over up: the epilogue's silu(gate) * up, bit for bit
    unfused = torch.empty(rows, n // 2, dtype=torch.bfloat16)
    torch.ops.tokenmill.silu_and_mul(unfused, _tiles(kernel, x, op=op))
    assert torch.equal(gated, unfused)


@needs_kernels
@pytest.mark.parametrize("bits,group", CASES)
def test_batch_sizes_take_the_quantized_kernels_paths(bits, group):
    """Small batches the VNNI kernel, then the tile matmul (whose bf16 panels make it differ from the VNNI
    kernel's result, so the checks tell the paths apart); with AMX it stops at max_rows and the dequantized
    oneDNN matmul takes the rest, without AMX the vector matmul takes every larger batch."""
    n, k = 96, 576
    w = _weight(n, k, seed=3)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group)
    kernel = QuantLinearKernel(qw, None, torch.bfloat16)
    amx = kernels.amx_available()
    assert kernel.tile_gemm == (torch.ops.tokenmill.quant_amx_gemm if amx else torch.ops.tokenmill.quant_vec_gemm)
    tile_rows = kernel.max_rows if amx else 600
    x = torch.randn(tile_rows + 1, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    for rows in (1, kernel.vnni_max_rows):
        assert torch.equal(kernel(x[:rows]), _vnni(kernel, x[:rows]))
    for rows in (kernel.vnni_max_rows + 1, tile_rows):
        assert torch.equal(kernel(x[:rows]), _tiles(kernel, x[:rows]))
        assert not torch.equal(_tiles(kernel, x[:rows]), _vnni(kernel, x[:rows]))
    if amx:
        assert torch.equal(kernel(x), kernel._dequantized_matmul(x))
    gate_up = x[:kernel.vnni_max_rows + 1]
    assert torch.equal(kernel.silu_and_mul(gate_up), _tiles(kernel, gate_up, gated=True))
    assert kernel.silu_and_mul(x[:kernel.vnni_max_rows]) is None
    assert (kernel.silu_and_mul(x) is None) == amx


@needs_kernels
@pytest.mark.parametrize("bits,group", CASES)
def test_quant_gemm_on_any_activations_within_their_quantization(bits, group):
    """Activations are quantized to int8 per 32 inputs: stated tolerance 2% of the output's largest value."""
    n, k = 96, 576
    w = _weight(n, k, seed=7)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group)
    kernel = QuantLinearKernel(qw, None, torch.bfloat16)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    ref = x.float() @ qw.dequantize().T
    assert (kernel(x).float() - ref).abs().max() <= 0.02 * ref.abs().max()


@needs_kernels
@pytest.mark.parametrize("bits,group", CASES)
def test_large_batches_dequantize_for_the_bf16_matmul(bits, group, monkeypatch):
    import tokenmill.layers.quant.kernel as qk

    n, k = 64 * 3, 128
    w = _weight(n, k, seed=9)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group)
    monkeypatch.setattr(qk, "DEQUANT_CHUNK_BYTES", 64 * k * 2)  # three pieces, as an lm head is cut
    kernel = QuantLinearKernel(qw, torch.randn(n).bfloat16(), torch.bfloat16)
    assert len(kernel.chunks) == 3
    x = torch.randn(40, k).bfloat16()   # (AMX hosts' layers take this path past max_rows)
    ref = x.float() @ qw.dequantize().bfloat16().float().T + kernel.bias.float()
    torch.testing.assert_close(kernel._dequantized_matmul(x).float(), ref, rtol=2**-7, atol=2e-3)


def test_fp32_and_odd_shapes_take_the_dequantized_reference():
    qw = quantize_int8(_weight(24, 64))  # 24 outputs: not whole blocks of 16
    kernel = QuantLinearKernel(qw, None, torch.bfloat16)
    assert not kernel.native
    fp32 = QuantLinearKernel(quantize_int8(_weight(32, 64)), None, torch.float32)
    assert not fp32.native and torch.equal(fp32.weight, quantize_int8(_weight(32, 64)).dequantize())


# ---- end to end -------------------------------------------------------------------------------------------------

def _quantize_hf_model(hf, method: str, group: int) -> None:
    """Replace every linear weight (and the lm head, int8 for int4 as the engine does) by its quantized-then-
    dequantized value, untying a tied head."""
    qfn = (lambda w: quantize_int8(w)) if method == "int8" else (lambda w: quantize_int4(w, group))
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(qfn(module.weight).dequantize())
        head = quantize_int8(hf.lm_head.weight).dequantize()
        hf.lm_head.weight = torch.nn.Parameter(head)


@pytest.mark.parametrize("family,method", [("llama", "int4"), ("qwen2", "int8"), ("qwen2", "int4")])
def test_quantized_tiny_model_matches_transformers_on_the_dequantized_weights(family, method, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(family)
    prompts = [[101, 2045, 777, 31000], list(range(300, 341))]
    llm = LLM(str(folder), dtype="float32", quantization=method, kv_cache_memory="32MiB")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _quantize_hf_model(hf, method, 32)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        logprobs = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
        ref, ref_logits = hf_greedy(hf, prompt, 24)
        assert_greedy_matches(tokens, logprobs, ref, ref_logits)


@needs_kernels
def test_quantized_tiny_model_in_bf16_runs_the_kernels(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen2")), dtype="bfloat16", quantization="int4", kv_cache_memory="32MiB")
    model = llm.engine_core.executor.runner.model
    assert all(layer.mlp.down_proj.kernel.native and layer.self_attn.qkv_proj.kernel.native
               for layer in model.model.layers)
    assert model.logits_head.native and model.logits_head.bits == 8  # int4's head is int8
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ---- bad settings -----------------------------------------------------------------------------------------------

def test_unknown_method_and_group_size_name_the_flag():
    with pytest.raises(ValueError, match="--quantization 'fp4' is not supported"):
        get_quant_method("fp4")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128"):
        get_quant_method("int4", 48)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        get_quant_method("gguf", model_format="hf")


def test_group_size_that_does_not_divide_a_layer_fails_at_start(tiny_model_dir):
    # the tiny models' hidden size is 64: groups of 128 do not divide it
    with pytest.raises(ValueError, match="--quantization-group-size 128 does not divide the input size 64"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", quantization="int4", quantization_group_size=128,
            kv_cache_memory="32MiB")


def test_quantized_weight_rows_reorder_every_part():
    qw = quantize_int4(_weight(4, 64), 32)
    flipped = qw.rows(torch.tensor([3, 2, 1, 0]))
    assert isinstance(flipped, QuantizedWeight)
    assert torch.equal(flipped.dequantize(), qw.dequantize().flip(0))
