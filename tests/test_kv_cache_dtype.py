"""Quantized KV caches (fp8 e4m3, fp8 e5m2, int8 with per-layer scales): every backend reads the stored values
as torch_ref does (decode fast path, generic path, prompts over cached context, the cascade prefix), the values
round-trip within the dtype's precision, and a cache of the same memory holds twice the blocks."""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import CASES, SHARED_PREFIX_CASES, _case, _shared_prefix_case

import tokenmill.kernels as kernels
from tokenmill import LLM, SamplingParams
from tokenmill.attention.ops import KV_CACHE_DTYPES, dequantize_kv, quantize_kv, write_kv
from tokenmill.attention.registry import get_backend

QUANTIZED = ["fp8", "fp8_e5m2", "int8"]
# largest relative error of one stored value (of the scale's range for int8)
PRECISION = {"fp8": 2**-4, "fp8_e5m2": 2**-3, "int8": 0.5 / 127}
SCALES = (0.04, 0.045)  # int8's K and V: ranges of +-5.1 and +-5.7, above every randn value here
LOGPROB_BOUND = {"fp8": 0.35, "int8": 0.35}  # measured: 0.17 and 0.20
ATTENTION_BOUND = {"fp8": 4.5 * 2**-4 * 1.5, "fp8_e5m2": 4.5 * 2**-3 * 1.5, "int8": 0.08}


def _quantized(cache: torch.Tensor, name: str) -> torch.Tensor:
    dtype = KV_CACHE_DTYPES[name][0]
    out = torch.empty(cache.shape, dtype=dtype)
    scales = SCALES if name == "int8" else (1.0, 1.0)
    for i in (0, 1):
        out[i] = quantize_kv(cache[i], scales[i], dtype)
    return out, scales


@pytest.mark.parametrize("name", QUANTIZED)
def test_values_round_trip_within_the_dtype_precision(name):
    x = torch.randn(1000).clamp(-3, 3) * 2  # within int8's range at scale 0.05 (6.35)
    dtype = KV_CACHE_DTYPES[name][0]
    scale = 0.05 if name == "int8" else 1.0
    back = dequantize_kv(quantize_kv(x, scale, dtype), scale, torch.float32)
    bound = PRECISION[name] * (x.abs() if name != "int8" else 127 * scale) + 1e-6
    assert ((back - x).abs() <= bound + 2**-9).all()  # (+ fp8's subnormal spacing near zero)
    assert quantize_kv(torch.tensor([1e9]), scale, dtype).float().item() == KV_CACHE_DTYPES[name][1]  # saturates


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size, hq, hkv, d", [(16, 9, 3, 64), (8, 4, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_reads_a_quantized_cache_as_the_reference(name, backend, case, block_size, hq, hkv, d, dtype):
    q_lens, ctx = CASES[case]
    q, k, v, cache, md = _case(q_lens, ctx, block_size, hq, hkv, d, dtype)
    qcache, (ks, vs) = _quantized(cache.float(), name)
    write_kv(qcache, k, v, md.slot_mapping, ks, vs)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, qcache, md, 0.125, k_scale=ks, v_scale=vs)
    out = get_backend(backend, "cpu").forward(q, k, v, qcache, md, 0.125, k_scale=ks, v_scale=vs)
    exact = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
    # whole prompts attend their fresh K/V, as vLLM does; everything with cached context reads the cache
    expected = exact if case == "prefill" else ref
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    # and the quantized cache stays close to attending the unquantized values: an output is a weighted mean of
    # values up to ~4.5 here, each stored within PRECISION (int8: half a step of 0.045)
    assert (ref.float() - exact.float()).abs().max() < ATTENTION_BOUND[name]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("case", sorted(SHARED_PREFIX_CASES))
def test_cascade_prefix_reads_a_quantized_cache(name, case):
    tails, q_lens = SHARED_PREFIX_CASES[case]
    q, k, v, cache, md = _shared_prefix_case(tails, q_lens, 20, 16, 9, 3, 64, torch.bfloat16)
    qcache, (ks, vs) = _quantized(cache.float(), name)
    write_kv(qcache, k, v, md.slot_mapping, ks, vs)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, qcache, md, 0.125, k_scale=ks, v_scale=vs)
    out = get_backend("cpu", "cpu").forward(q, k, v, qcache, md, 0.125, k_scale=ks, v_scale=vs)
    assert md.backend_plan["cpu"].prefix is not None
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _centred(cache: torch.Tensor, k, v, md, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache holding K less `offset` (what write_kv stores with k_offset), and an fp32 cache of the keys
    and values it stands for (its K read back plus the offset)."""
    qcache, _ = _quantized(cache.float() - torch.stack([offset, torch.zeros_like(offset)])[:, None, None], "fp8")
    write_kv(qcache, k, v, md.slot_mapping, k_offset=offset)
    meant = qcache.float()
    meant[0] += offset
    return qcache, meant


@pytest.mark.parametrize("backend", ["torch_ref", "torch_sdpa", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES) + [f"shared/{c}" for c in sorted(SHARED_PREFIX_CASES)])
def test_centred_keys_are_attended_as_the_keys_they_stand_for(backend, case):
    """A quantized cache that stores K less a per-channel offset is read without adding it back: every path must
    give what attending offset + stored K gives (exact, since all keys of a softmax row move by one vector),
    and never mix those keys with fresh, uncentred ones (a large offset makes any such mix show)."""
    if case.startswith("shared/"):
        q, k, v, cache, md = _shared_prefix_case(*SHARED_PREFIX_CASES[case[7:]], 20, 16, 9, 3, 64, torch.float32)
    else:
        q, k, v, cache, md = _case(*CASES[case], 16, 9, 3, 64, torch.float32)
    offset = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)) * 8
    qcache, meant = _centred(cache, k, v, md, offset)
    out = get_backend(backend, "cpu").forward(q, k, v, qcache, md, 0.125)
    # whole prompts attend their fresh K/V (but in torch_ref, which reads everything from the cache)
    fresh = case == "prefill" and backend != "torch_ref"
    expected = get_backend("torch_ref", "cpu").forward(q, k, v, cache if fresh else meant, md, 0.125)
    if case.startswith("shared/") and backend == "cpu":
        assert md.backend_plan["cpu"].prefix is not None
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_same_memory_holds_twice_the_blocks(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    plain = LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB")
    fp8 = LLM(folder, dtype="bfloat16", kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    assert fp8.config.cache_config.num_blocks == 2 * plain.config.cache_config.num_blocks
    cache = fp8.engine_core.executor.runner.kv_caches[0]
    assert cache.dtype == torch.float8_e4m3fn and cache.element_size() == 1


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_engine_with_a_quantized_cache_follows_the_unquantized_one(name, smol_llm, smol_tokenizer):
    """SmolLM2 in fp32: int8 calibrates its scales on the warm-up step, and each token generated while reading
    the quantized cache gets nearly the logprob that the unquantized engine gives the same sequence (largest
    gaps measured: 0.17 for fp8, 0.20 for int8). The exactness of each read is tested above, per backend."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=name)
    layer = llm.engine_core.executor.runner.model.attention_layers()[0]
    assert (layer.k_scale != 1.0) == (name == "int8") and not layer.calibrate
    assert layer.k_offset is not None and layer.k_offset.shape == (layer.num_kv_heads, layer.head_dim)
    prompts = [smol_tokenizer(t).input_ids for t in ("The history of the printing press began",
                                                     "def add(a, b):\n    return")]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
        scored = smol_llm.generate({"prompt_token_ids": prompt + tokens},
                                   SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        theirs = [d[t].logprob for d, t in zip(scored[0].prompt_logprobs[len(prompt):], tokens)]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < LOGPROB_BOUND[name]


def test_unknown_kv_cache_dtype_names_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp4' is not supported"):
        LLM(kv_cache_dtype="fp4", kv_cache_memory="16MiB")


@pytest.mark.skipif(not kernels.native_kernels_for(torch.empty(0, dtype=torch.bfloat16)),
                    reason="the native kernels need AVX-512 BF16")
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 32)])
@pytest.mark.parametrize("centred", [False, True])
def test_rope_and_cache_writes_the_quantized_values_write_kv_writes(name, hq, hkv, d, centred):
    """The fused kernel's cache write (value / scale, saturated, rounded to nearest even) stores what the torch
    path stores; fp8 goes through fp16 there, so a value may land one step away where that double rounding
    differs (never more)."""
    from tokenmill.layers.rotary import RotaryEmbedding

    t, block_size, num_blocks = 13, 4, 8
    rope = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.arange(t) * 7
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))[:t]
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).bfloat16()
    qkv[0, hq * d] = 1e30  # saturates (position 0: the rotation is the identity)
    qkv[1, hq * d: hq * d + 8] = 1e-6  # fp8 subnormals / zero
    dtype, limit = KV_CACHE_DTYPES[name]
    ks, vs = (0.03, 0.05) if name == "int8" else (0.5, 2.0)
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=dtype)
    q = torch.empty(t, hq, d, dtype=torch.bfloat16)
    fused_qkv = qkv.clone()
    offset = torch.randn(hkv, d, generator=g) * 4 if centred else None
    torch.ops.tokenmill.rope_and_cache(q, fused_qkv, positions, rope.cos, rope.sin, cache[0], cache[1], slots, hq,
                                       hkv, ks, vs, offset)
    k_rotated = fused_qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    ref = torch.zeros_like(cache)
    write_kv(ref, k_rotated, v, slots, ks, vs, offset)
    got, want = cache.view(2, -1, hkv, d)[:, slots].float(), ref.view(2, -1, hkv, d)[:, slots].float()
    step = PRECISION[name] * 2 * want.abs() if name != "int8" else torch.ones_like(want)
    assert ((got - want).abs() <= step + 2**-9).all()
    assert (got == want).float().mean() > 0.99
    assert got[0, 0, 0, 0] == limit  # saturated, not inf or NaN
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.view(2, -1, hkv, d)[:, untouched].float().any()
