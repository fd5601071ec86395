"""The native bf16 kernels (tiled matmuls, norms, silu-and-mul, rope-and-cache) agree with their torch
references computed in fp32, to bf16 rounding; and a whole bf16 model using them is as close to fp32 as the
torch bf16 path is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tokenmill.kernels as kernels
from tokenmill.kernels import amx_available, native_kernels_for
from tokenmill.layers.packed_weight import SKINNY_MAX_ROWS, PackedWeight
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not native_kernels_for(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="the native bf16 kernels need AVX-512 BF16 and a compiler")

BF16_EPS = 2.0**-8  # one bf16 rounding, relative


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0):
    """Within a couple of bf16 roundings of the fp32 reference, measured against the reference's scale."""
    err = (out.float() - ref.float()).abs().max().item()
    bound = ulps * BF16_EPS * ref.float().abs().max().item()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def _linear_case(m, k, n, bias):
    x, w = _rand(m, k, seed=1), _rand(n, k, seed=2)
    b = _rand(n, seed=3) if bias else None
    return x, w, b, F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 48), (96, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_skinny_gemm(m, k, n, bias):
    x, w, b, ref = _linear_case(m, k, n, bias)
    out = torch.ops.tokenmill.tiled_skinny_gemm(x, torch.ops.tokenmill.pack_tiles(w), b, n)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _assert_bf16_close(out, ref)


def test_verified_drafts_get_the_bits_of_decoding_alone():
    """A row of up to KERNEL_MAX_QUERY_LEN new tokens (drafts being verified, and the bonus token) gets each
    token's attention alone; the linears must do the same: each row of such a batch is bit for bit what it gets
    alone, so bf16 speculation cannot change a greedy answer (with AMX taking 5+ rows, they differed)."""
    from tokenmill.attention.cpu import KERNEL_MAX_QUERY_LEN

    assert SKINNY_MAX_ROWS >= KERNEL_MAX_QUERY_LEN
    x, w, b, _ = _linear_case(KERNEL_MAX_QUERY_LEN, 576, 960, True)
    packed = PackedWeight(w, b)
    together = packed(x)
    for m in range(1, KERNEL_MAX_QUERY_LEN + 1):
        assert torch.equal(packed(x[:m]), together[:m]), m


TILE_GEMMS = ["amx_gemm", "vec_gemm"]


def _tile_gemm(name: str):
    """A tile matmul op by name (AMX's, or the vectors' that CPUs without AMX run), or a skip where this CPU
    cannot run it."""
    if name == "amx_gemm" and not amx_available():
        pytest.skip("the AMX matmul needs a CPU with AMX")
    return getattr(torch.ops.tokenmill, name)


@pytest.mark.parametrize("gemm", TILE_GEMMS)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 100, 128, 300])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_gemm(gemm, m, k, n, bias):
    """Row counts that fill whole 32-row tile pairs (12-row register tiles), part of one, and several chunks of
    x; an odd number of 16-output blocks (48) leaves a single block at the end of a thread's range."""
    x, w, b, ref = _linear_case(m, k, n, bias)
    out = _tile_gemm(gemm)(x, torch.ops.tokenmill.pack_tiles(w), b, n)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _assert_bf16_close(out, ref)


@pytest.mark.parametrize("gemm", TILE_GEMMS)
@pytest.mark.parametrize("m", [5, 33, 128])
@pytest.mark.parametrize("k, i", [(576, 1536), (64, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_gemm_gated(gemm, m, k, i, bias):
    """silu(gate) * up in the matmul's epilogue: the same bits as the matmul followed by silu_and_mul (it
    rounds gate and up to bf16 as they do), and close to the fp32 MLP activation. An odd number of 16-output
    blocks per half (48 = 3) pairs gate block j with up block j + 3, not with its neighbour."""
    op = _tile_gemm(gemm)
    x, w, b, ref = _linear_case(m, k, 2 * i, bias)
    tiles = torch.ops.tokenmill.pack_tiles(w)
    fused = op(x, tiles, b, 2 * i, True)
    unfused = torch.empty(m, i, dtype=torch.bfloat16)
    torch.ops.tokenmill.silu_and_mul(unfused, op(x, tiles, b, 2 * i))
    assert fused.shape == (m, i) and torch.equal(fused, unfused)
    _assert_bf16_close(fused, F.silu(ref[:, :i]) * ref[:, i:], ulps=4.0)


def test_vector_matmul_rows_keep_their_bits_in_any_batch():
    """The vector matmul sums each row alone, in the skinny kernel's order: a row gets the same bits in a batch
    of any size (so a token's logits do not depend on what else is in its step) and the skinny kernel's bits."""
    x, w, b, _ = _linear_case(40, 576, 960, True)
    tiles = torch.ops.tokenmill.pack_tiles(w)
    together = torch.ops.tokenmill.vec_gemm(x, tiles, b, 960)
    for lo, hi in ((0, 1), (3, 8), (0, 13), (7, 40)):
        assert torch.equal(torch.ops.tokenmill.vec_gemm(x[lo:hi], tiles, b, 960), together[lo:hi]), (lo, hi)
    assert torch.equal(torch.ops.tokenmill.tiled_skinny_gemm(x[:8], tiles, b, 960), together[:8])


def _prompt_kernel(name: str):
    """A native prompt-attention op by name, or a skip where this CPU cannot run it."""
    if name == "amx_prefill_attention" and not amx_available():
        pytest.skip("the AMX attention needs a CPU with AMX")
    if not kernels.has_op(name):
        pytest.skip("the native prompt kernel needs AVX-512 BF16")
    return getattr(torch.ops.tokenmill, name)


PROMPT_KERNELS = ["amx_prefill_attention", "prefill_attention"]


@pytest.mark.parametrize("kernel", PROMPT_KERNELS)
@pytest.mark.parametrize("rows, context", [(1, 0), (3, 29), (5, 0), (16, 0), (17, 3), (33, 31), (40, 0), (100, 500),
                                           (257, 0), (64, 992)])
def test_prefill_attention(kernel, rows, context):
    """Causal attention of a prompt or of a chunk after cached context, with GQA, K/V read through the strides
    of the fused qkv output, against fp32 attention with the same inputs. Row counts that fill the kernels' row
    tiles (4 and 16) or not, contexts that end inside a 32-key step or on its edge."""
    qkv = _rand(context + rows, 960, seed=7)
    k, v = qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)
    q = _rand(rows, 9, 64, seed=8)
    out = torch.empty(rows, 9, 64, dtype=torch.bfloat16)
    _prompt_kernel(kernel)(out, q, k, v, 0.125, context)
    mask = torch.arange(context + rows)[None, :] <= torch.arange(context, context + rows)[:, None]
    ref = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    assert (out.float() - ref).abs().max().item() <= 0.02  # P and the output are rounded to bf16 (values ~1)


@pytest.mark.parametrize("kernel", PROMPT_KERNELS)
@pytest.mark.parametrize("rows, context", [(40, 0), (20, 300)])
def test_prefill_attention_rescales_as_scores_grow(kernel, rows, context):
    """Keys that grow along the sequence raise each row's maximum score by far more than the kernels' lazy
    margin (8) as it walks them, so the output and sum accumulated so far must be rescaled (with the random keys
    above the first maximum is never passed by that much, and a kernel that skipped the rescale passed)."""
    growth = torch.linspace(0.2, 3.0, context + rows)[:, None, None]
    k = (_rand(context + rows, 3, 64, seed=11).float() * growth).bfloat16()
    v, q = _rand(context + rows, 3, 64, seed=12), _rand(rows, 9, 64, seed=13)
    out = torch.empty(rows, 9, 64, dtype=torch.bfloat16)
    _prompt_kernel(kernel)(out, q, k, v, 0.5, context)
    mask = torch.arange(context + rows)[None, :] <= torch.arange(context, context + rows)[:, None]
    ref = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=0.5, enable_gqa=True)[0].transpose(0, 1)
    assert (out.float() - ref).abs().max().item() <= 0.02


@pytest.mark.parametrize("kernel", PROMPT_KERNELS)
@pytest.mark.parametrize("rows, keys", [(1, 256), (40, 1024), (17, 300)])
def test_prefill_attention_over_a_shared_prefix(kernel, rows, keys):
    """Not causal (every query sees every key, as over a cascade's shared prefix), with the log-sum-exps that
    the merge of partial results needs."""
    kv = _rand(keys, 2, 3, 64, seed=9)
    k, v = kv[:, 0], kv[:, 1]
    q = _rand(rows, 9, 64, seed=10)
    out, lse = torch.empty(rows, 9, 64, dtype=torch.bfloat16), torch.empty(rows, 9)
    _prompt_kernel(kernel)(out, q, k, v, 0.125, 0, False, lse)
    scores = torch.einsum("rhd,shd->rhs", q.float(), k.float().repeat_interleave(3, dim=1)) * 0.125
    ref = torch.einsum("rhs,shd->rhd", scores.softmax(-1), v.float().repeat_interleave(3, dim=1))
    assert (out.float() - ref).abs().max().item() <= 0.02
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=2e-2, rtol=0)


def test_prompts_take_a_native_kernel():
    """Wherever the bf16 kernels are built, bf16 prompts of head_dim 64 go to a native kernel (AMX's where the CPU
    has AMX), not to SDPA, which on CPUs without AMX turns bf16 into fp32 for MKL (4-6x slower)."""
    from tokenmill.attention.cpu import CpuPagedBackend

    backend = CpuPagedBackend()
    expected = "amx_prefill_attention" if amx_available() else "prefill_attention"
    if not kernels.has_op(expected):   # the portable (AVX2, NEON) kernels: prompts go to SDPA
        assert backend._prefill_op is None
        assert not backend._prefill_takes(torch.empty(4, 9, 64, dtype=torch.bfloat16))
        return
    assert backend._prefill_op == getattr(torch.ops.tokenmill, expected)
    assert backend._prefill_takes(torch.empty(4, 9, 64, dtype=torch.bfloat16))
    assert not backend._prefill_takes(torch.empty(4, 9, 64))
    assert not backend._prefill_takes(torch.empty(4, 9, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("k, n", [(576, 960), (100, 37)])
def test_packed_weight_every_batch_size(k, n):
    """PackedWeight takes the skinny, AMX or oneDNN matmul by batch size, or only oneDNN where the shape does
    not fit the tile layout; every path gives the same linear."""
    w, b = _rand(n, k, seed=2), _rand(n, seed=3)
    packed = PackedWeight(w, b)
    assert (packed.tiles is not None) == (n % 16 == 0 and k % 32 == 0)
    for m in (1, 4, 8, 9, 64, 128, 129, 300):
        x = _rand(m, k, seed=m)
        _assert_bf16_close(packed(x), F.linear(x.float(), w.float(), b.float()))


def test_packed_weight_gated_wherever_the_tile_matmul_runs():
    """The fused silu(gate) * up is offered wherever the tile matmul (AMX, or vectors without it) takes more
    rows than the skinny matmul; elsewhere the caller falls back to the matmul and silu_and_mul."""
    packed = PackedWeight(_rand(96, 64, seed=2), None)
    for m in (1, 4, 8, 9, 128, 129, 600):
        x = _rand(m, 64, seed=m)
        h = packed.silu_and_mul(x)
        takes = packed.tiles is not None and m > packed.skinny_max_rows
        assert (h is not None) == takes
        if takes:
            gu = packed(x).float()
            _assert_bf16_close(h, F.silu(gu[:, :48]) * gu[:, 48:], ulps=4.0)
    halves_not_whole_blocks = PackedWeight(_rand(48, 64, seed=2), None)  # tiles of 16, but halves of 24
    assert halves_not_whole_blocks.silu_and_mul(_rand(8, 64)) is None


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("t, d", [(1, 576), (5, 64), (33, 100)])
def test_rms_norms(t, d):
    x, res, w = _rand(t, d, seed=1), _rand(t, d, seed=2, scale=3.0), _rand(d, seed=3)
    out = torch.empty_like(x)
    torch.ops.tokenmill.rms_norm(out, x, w, 1e-5)
    _assert_bf16_close(out, _rms_ref(x, w, 1e-5))

    summed = (x.float() + res.float()).to(torch.bfloat16)  # the unfused model rounds the residual sum
    x2, res2 = x.clone(), res.clone()
    torch.ops.tokenmill.add_rms_norm(x2, res2, w, 1e-5)
    assert torch.equal(res2, summed)
    _assert_bf16_close(x2, _rms_ref(summed, w, 1e-5))


@pytest.mark.parametrize("t, d", [(1, 1536), (7, 40), (64, 128)])
def test_silu_and_mul(t, d):
    x = _rand(t, 2 * d, seed=4, scale=4.0)
    out = torch.empty(t, d, dtype=torch.bfloat16)
    torch.ops.tokenmill.silu_and_mul(out, x)
    gate, up = x.float().chunk(2, dim=-1)
    _assert_bf16_close(out, F.silu(gate) * up)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_and_cache(hq, hkv, d):
    t, block_size, num_blocks = 11, 4, 8
    rope = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 1, 2, 3, 4, 200, 17, 18, 5, 6, 7])
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))[:t]
    qkv = _rand(t, (hq + 2 * hkv) * d, seed=5)
    q_ref, k_ref, v = qkv.float().split([hq * d, hkv * d, hkv * d], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(t, hq, d), k_ref.reshape(t, hkv, d))
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=torch.bfloat16)
    q = torch.empty(t, hq, d, dtype=torch.bfloat16)
    torch.ops.tokenmill.rope_and_cache(q, qkv, positions, rope.cos, rope.sin, cache[0], cache[1], slots, hq, hkv)
    _assert_bf16_close(q, q_ref)
    k_rotated = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    _assert_bf16_close(k_rotated, k_ref)
    flat = cache.view(2, -1, hkv, d)
    assert torch.equal(flat[0, slots], k_rotated)
    assert torch.equal(flat[1, slots], v.reshape(t, hkv, d).to(torch.bfloat16))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


def _score(llm, sequences):
    """fp32 logprob of each token after the first, given the tokens before it (prompt logprobs)."""
    from tokenmill import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[d[tok].logprob for d, tok in zip(o.prompt_logprobs[1:], seq[1:])] for o, seq in zip(outs, sequences)]


def _bf16_error(llm_bf16, llm_fp32, prompts):
    """Largest gap between the bf16 engine's logprobs of its own greedy tokens and fp32's scores of them."""
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm_bf16.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    ref = _score(llm_fp32, sequences)
    worst = 0.0
    for p, o, r in zip(prompts, outs, ref):
        ours = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
        ours += [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, r)))
    return worst


def test_bf16_model_with_native_kernels_as_close_to_fp32_as_torch_path(tiny_model_dir, monkeypatch):
    """Prefill and decode steps (1-3 rows take the skinny matmul, prompts the AMX one where the CPU has it)
    against fp32 scores of the same tokens."""
    import tokenmill.kernels
    from tokenmill import LLM

    folder = str(tiny_model_dir("qwen2"))  # q/k/v bias and tied embeddings
    prompts = [[(37 * i + 11 * j) % 49000 + 100 for j in range(n)] for i, n in enumerate([5, 23, 40])]
    args = dict(kv_cache_memory="16MiB", block_size=16, attention_backend="cpu")
    fp32 = LLM(folder, dtype="float32", **args)
    native_err = _bf16_error(LLM(folder, dtype="bfloat16", **args), fp32, prompts)
    monkeypatch.setattr(tokenmill.kernels, "native_kernels_for", lambda t: False)
    torch_err = _bf16_error(LLM(folder, dtype="bfloat16", **args), fp32, prompts)
    assert torch_err > 0  # bf16 really ran
    assert native_err <= 1.5 * torch_err + 0.02, (native_err, torch_err)


@pytest.mark.parametrize("b, vocab", [(1, 49152), (5, 1000), (3, 17)])
def test_argmax_rows_first_maximum(b, vocab):
    logits = _rand(b, vocab, seed=6)
    logits[0, vocab // 3] = logits[0, vocab - 1] = 50.0  # a tie: the first index wins, as torch.argmax
    logits[-1, :] = -3.0                                 # a row of equal values
    out = torch.ops.tokenmill.argmax_rows(logits)
    assert torch.equal(out, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("out_sizes", [[96], [64, 32, 32]])
@pytest.mark.skipif(not kernels.has_op("lora_sgmv"), reason="the LoRA kernel needs AVX-512 BF16")
def test_lora_sgmv_matches_the_masked_torch_path(tokens, out_sizes):
    """The segmented LoRA kernel (tokens grouped by slot, blocks of four with short tails) against the same
    adapters through the torch path in fp32: slot 1 is never used, a third of the tokens run the base model, the
    adapters' ranks (3, 8) are below the slots' width, and fused projections keep to their own columns."""
    import numpy as np

    from tokenmill.lora.layers import LoRALinearWeights, LoRAStep

    in_features, rank, slots = 80, 8, 4
    native, ref = LoRAStep(torch.bfloat16), LoRAStep(torch.float32)
    w = LoRALinearWeights(in_features, out_sizes, slots, rank, native, torch.bfloat16)
    w32 = LoRALinearWeights(in_features, out_sizes, slots, rank, ref, torch.float32)
    assert w.native and not w32.native
    for slot, r in ((0, 3), (2, 8), (3, 5)):
        shards = {k: (_rand(r, in_features, seed=slot + k, scale=0.2), _rand(size, r, seed=9 + slot + k, scale=0.2))
                  for k, size in enumerate(out_sizes)}
        w.set_slot(slot, shards)
        w32.set_slot(slot, shards)
    token_slot = np.array([(-1, 0, 2, 3)[i % 4] if i % 3 else -1 for i in range(tokens)])
    token_slot[0] = 3
    native.begin(token_slot)
    ref.begin(token_slot)
    x = _rand(tokens, in_features, seed=3).to(torch.bfloat16)
    y = _rand(tokens, sum(out_sizes), seed=4).to(torch.bfloat16)
    expected = w32.apply(x.float(), y.float().clone())
    out = w.apply(x, y.clone())
    assert not torch.equal(expected, y.float())   # the adapters did something
    _assert_bf16_close(out, expected)
    base = torch.from_numpy(token_slot < 0)
    assert torch.equal(out[base], y[base])   # base-model tokens are untouched, bit for bit


def test_a_built_library_loads_without_asking_ninja(monkeypatch):
    """The build folder is named by a hash of every input, so where its library exists it is loaded as it is: a
    checkout or sync that only touches the sources' times must not cost a rebuild (ninja goes by times)."""
    from torch.utils import cpp_extension

    import tokenmill.kernels.build as build

    native = build.BUILDS["native"]
    assert (build._build_dir(native) / f"{native.name}.so").exists()   # the library these tests ran on

    def rebuild(**kwargs):
        raise AssertionError("cpp_extension.load was called")

    monkeypatch.setattr(cpp_extension, "load", rebuild)
    build.load_cpu_kernels.cache_clear()
    try:
        assert build.load_cpu_kernels()
    finally:
        build.load_cpu_kernels.cache_clear()
