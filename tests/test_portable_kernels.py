"""The portable kernels (AVX2 here, ARM NEON under qemu) and the kernel-set selection (--cpu-isa).

On a CPU with AVX-512 BF16 the AVX2 set is the AVX2-only build (`torch.ops.tokenmill_avx2`), and where the
AVX-512 kernels define the bits (the matmuls, the norms, rope) the AVX2 ones must give those bits exactly; on an
AVX2-only CPU it is the native build. Everywhere both are checked against an fp32 reference, and the NEON build
of the same header (tests/native/portable_harness.cpp) must give the AVX2 kernels' bits.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmill.kernels as kernels
from tokenmill.cpu_isa import KernelSet, detect_isa, resolve_cpu_isa
from tokenmill.kernels.build import BUILDS, load_cpu_kernels
from tokenmill.layers.quant.kernel import pack_for_kernels
from tokenmill.layers.quant.tensor import QuantizedWeight

HARNESS = Path(__file__).parent / "native" / "portable_harness.cpp"
AVX512_FLAGS = frozenset("avx2 fma f16c bmi2 avx512f avx512bw avx512_vnni avx512_bf16".split())
AMX_FLAGS = AVX512_FLAGS | {"amx_tile", "amx_bf16", "amx_int8"}
AVX2_FLAGS = frozenset("avx2 fma f16c bmi2".split())


def _sets():
    """(the AVX2 kernels' ops, the AVX-512 ops whose bits they must equal, or None on an AVX2-only CPU)."""
    try:
        k = resolve_cpu_isa("avx2")
    except ValueError:
        pytest.skip("this CPU has no AVX2")
    if not load_cpu_kernels(variant=k.build):
        pytest.skip("the AVX2 kernels did not build")
    avx512 = torch.ops.tokenmill if k.build == "avx2" and load_cpu_kernels() else None
    return getattr(torch.ops, BUILDS[k.build].namespace), avx512


def _rand(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _close_bf16(got, want, ulps=2.0):
    """Within `ulps` of bf16's rounding of each value (summation order moves a result by an ulp or so)."""
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= ulps * 2**-8 * want.abs() + 1e-6).all(), (got - want).abs().max()


# ---- the selection ----

@pytest.mark.parametrize("flags, machine, want", [
    (AMX_FLAGS, "x86_64", "amx"), (AVX512_FLAGS, "x86_64", "avx512"), (AVX2_FLAGS, "x86_64", "avx2"),
    (frozenset({"sse4_2"}), "x86_64", "none"), (frozenset(), "aarch64", "neon")])
def test_detect_picks_the_best_set(flags, machine, want):
    assert detect_isa(flags, machine) == want


def test_resolve_names_each_set_and_refuses_what_the_cpu_lacks():
    assert resolve_cpu_isa("auto", AMX_FLAGS, "x86_64") == KernelSet("amx", "native", amx=True)
    assert resolve_cpu_isa("avx512", AMX_FLAGS, "x86_64") == KernelSet("avx512", "native", amx=False)
    assert resolve_cpu_isa("avx2", AMX_FLAGS, "x86_64") == KernelSet("avx2", "avx2")   # the AVX2-only build
    assert resolve_cpu_isa("avx2", AVX2_FLAGS, "x86_64") == KernelSet("avx2", "native")
    assert resolve_cpu_isa("none", AVX2_FLAGS, "x86_64") == KernelSet("none", None)
    assert resolve_cpu_isa("auto", frozenset(), "aarch64") == KernelSet("neon", "native")
    for requested, flags, machine in [("amx", AVX512_FLAGS, "x86_64"), ("avx512", AVX2_FLAGS, "x86_64"),
                                      ("neon", AVX2_FLAGS, "x86_64"), ("avx2", frozenset(), "aarch64"),
                                      ("avx2", frozenset({"sse4_2"}), "x86_64"), ("sse", AVX2_FLAGS, "x86_64")]:
        with pytest.raises(ValueError, match="cpu_isa"):
            resolve_cpu_isa(requested, flags, machine)


def test_engine_args_refuse_a_set_this_cpu_lacks():
    from tokenmill.config import EngineArgs
    from tokenmill.engine.create_config import create_engine_config

    lacking = "avx2" if platform.machine().lower() in ("aarch64", "arm64") else "neon"
    with pytest.raises(ValueError, match="cpu_isa"):
        create_engine_config(EngineArgs(cpu_isa=lacking))


def test_dtype_follows_the_kernel_set():
    from tokenmill.cpu_isa import cpu_flags
    from tokenmill.platform import default_dtype

    assert default_dtype("cpu", "none") == "float32"   # torch's own operators: fp32 is their fast path
    if detect_isa(cpu_flags(), platform.machine()) != "none":   # bf16 kept, fp32 computed (or bf16 dot products)
        assert default_dtype("cpu", "auto") == "bfloat16"


# ---- the kernels against the reference and the AVX-512 bits ----

@pytest.mark.parametrize("t, d", [(1, 576), (5, 40), (3, 1000)])
def test_norms(t, d):
    ops, avx512 = _sets()
    x, w, res = _rand(t, d, seed=1), _rand(d, seed=2), _rand(t, d, seed=3)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    xf = x.float()
    _close_bf16(out, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float())
    x2, r2 = x.clone(), res.clone()
    ops.add_rms_norm(x2, r2, w, 1e-5)
    assert torch.equal(r2, (x.float() + res.float()).bfloat16())
    s = r2.float()
    _close_bf16(x2, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float())
    if avx512 is not None:
        want = torch.empty_like(x)
        avx512.rms_norm(want, x, w, 1e-5)
        assert torch.equal(out, want)
        x3, r3 = x.clone(), res.clone()
        avx512.add_rms_norm(x3, r3, w, 1e-5)
        assert torch.equal(x2, x3) and torch.equal(r2, r3)


def test_silu_and_mul_and_argmax():
    ops, _ = _sets()
    x = _rand(4, 2 * 100, seed=4, scale=4.0)
    out = torch.empty(4, 100, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    _close_bf16(out, F.silu(x[:, :100].float()) * x[:, 100:].float())
    logits = _rand(3, 1000, seed=5)
    logits[0, 333] = logits[0, 999] = 50.0   # a tie: the first wins
    logits[2] = -3.0
    assert torch.equal(ops.argmax_rows(logits), logits.float().argmax(-1))


def test_rope_and_cache():
    from tokenmill.layers.rotary import RotaryEmbedding

    ops, avx512 = _sets()
    hq, hkv, d, t = 6, 2, 64, 5
    rope = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"})
    positions, slots = torch.tensor([0, 3, 17, 100, 255]), torch.tensor([9, 0, 4, 31, 12])
    qkv = _rand(t, (hq + 2 * hkv) * d, seed=6)
    cache = torch.zeros(2, 8, 4, hkv, d, dtype=torch.bfloat16)
    q, fused = torch.empty(t, hq, d, dtype=torch.bfloat16), qkv.clone()
    ops.rope_and_cache(q, fused, positions, rope.cos, rope.sin, cache[0], cache[1], slots, hq, hkv)
    heads = qkv.float().view(t, hq + 2 * hkv, d)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    rotated = heads * cos + torch.cat([-heads[..., d // 2:], heads[..., :d // 2]], -1) * sin
    _close_bf16(q, rotated[:, :hq])
    flat = cache.view(2, 32, hkv, d)
    _close_bf16(flat[0, slots], rotated[:, hq:hq + hkv])
    assert torch.equal(flat[1, slots], qkv.view(t, hq + 2 * hkv, d)[:, hq + hkv:])
    if avx512 is not None:
        q2, fused2, cache2 = torch.empty_like(q), qkv.clone(), torch.zeros_like(cache)
        avx512.rope_and_cache(q2, fused2, positions, rope.cos, rope.sin, cache2[0], cache2[1], slots, hq, hkv)
        assert torch.equal(q, q2) and torch.equal(cache, cache2)


@pytest.mark.parametrize("m", [1, 2, 4, 5, 9, 33])
def test_tile_matmul(m):
    ops, avx512 = _sets()
    n, k = 96, 128
    w, b, x = _rand(n, k, seed=7), _rand(n, seed=8), _rand(m, k, seed=m)
    tiles = ops.pack_tiles(w)
    y = ops.vec_gemm(x, tiles, b, n)
    _close_bf16(y, F.linear(x.float(), w.float(), b.float()), ulps=4.0)
    assert torch.equal(ops.tiled_skinny_gemm(x, tiles, b, n), y)
    for lo, hi in [(0, 1), (1, m)]:   # a row's sums do not depend on the rows beside it
        if hi > lo:
            assert torch.equal(ops.vec_gemm(x[lo:hi], tiles, b, n), y[lo:hi])
    gated, unfused = ops.vec_gemm(x, tiles, b, n, True), torch.empty(m, n // 2, dtype=torch.bfloat16)
    ops.silu_and_mul(unfused, y)
    assert torch.equal(gated, unfused)
    if avx512 is not None:
        assert torch.equal(avx512.pack_tiles(w), tiles)
        assert torch.equal(avx512.vec_gemm(x, tiles, b, n), y)


def _quantized(bits, group, n=64, k=256, seed=9):
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q, mn = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), None
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        mn = torch.randn(n, k // group, generator=g) * 0.1
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()  # as the kernels keep them
    return QuantizedWeight(q, scale, None if mn is None else mn.half().float(), bits, group)


QUANT_CASES = [(8, 256), (8, 32), (4, 32), (4, 128)]


@pytest.mark.parametrize("bits, group", QUANT_CASES)
@pytest.mark.parametrize("m", [1, 3, 6, 17])
def test_quantized_matmuls(bits, group, m):
    ops, avx512 = _sets()
    qw = _quantized(bits, group)
    n, k = qw.q.shape
    q, scale, mn = pack_for_kernels(qw)
    bias, x = torch.randn(n), _rand(m, k, seed=m)
    ref = x.float() @ qw.dequantize().float().T + bias
    small = ops.quant_gemm(x, q, scale, mn, bias, bits, group, n)
    # x is kept as int8 pairs finer than its bf16 rounding: bf16 output rounding and a little more
    torch.testing.assert_close(small.float(), ref, rtol=2**-7, atol=2e-3 * ref.abs().max().item())
    tiles = ops.quant_vec_gemm(x, q, scale, mn, bias, bits, group, n, False)
    torch.testing.assert_close(tiles.float(), ref, rtol=2**-6, atol=4e-3 * ref.abs().max().item())
    gated, unfused = ops.quant_vec_gemm(x, q, scale, mn, bias, bits, group, n, True), torch.empty(m, n // 2).bfloat16()
    ops.silu_and_mul(unfused, tiles)
    assert torch.equal(gated, unfused)
    w_t = ops.quant_dequantize_t(q, scale, mn, bits, group, n, k, 1, 3)
    _close_bf16(w_t, qw.dequantize().float()[16:48].T, ulps=1.0)   # (a fused multiply-add: an ulp at most)
    if avx512 is not None:   # the exact integer sums, scaled in the same order
        assert torch.equal(avx512.quant_gemm(x, q, scale, mn, bias, bits, group, n), small)
        assert torch.equal(avx512.quant_dequantize_t(q, scale, mn, bits, group, n, k, 1, 3), w_t)


# ---- a model on the AVX2 set ----

def test_bf16_and_int4_models_on_the_avx2_set(tiny_model_dir):
    """The AVX2 set runs a whole model (its native decoder stack for decodes, SDPA for prompts where it has no
    prompt kernel) as close to fp32 as torch's own bf16 path, in bf16 and with int4 weights (against the same
    int4 weights in fp32)."""
    from test_native_kernels import _bf16_error

    from tokenmill import LLM

    _sets()
    folder = str(tiny_model_dir("qwen2"))
    prompts = [[(37 * i + 11 * j) % 49000 + 100 for j in range(n)] for i, n in enumerate([5, 23, 40])]
    args = dict(kv_cache_memory="16MiB", block_size=16)
    fp32 = LLM(folder, dtype="float32", cpu_isa="none", **args)
    torch_err = _bf16_error(LLM(folder, dtype="bfloat16", cpu_isa="none", **args), fp32, prompts)
    avx2 = LLM(folder, dtype="bfloat16", cpu_isa="avx2", attention_backend="cpu", **args)
    assert kernels.active().isa == "avx2"
    avx2_err = _bf16_error(avx2, fp32, prompts)
    assert 0 < avx2_err <= 1.5 * torch_err + 0.02, (avx2_err, torch_err)
    # int4 weights quantized from the bf16 ones: against the same model in fp32, as close as torch's bf16 path
    int4_fp32 = LLM(folder, dtype="float32", cpu_isa="none", quantization="int4", **args)
    int4_torch = _bf16_error(LLM(folder, dtype="bfloat16", cpu_isa="none", quantization="int4", **args), int4_fp32,
                             prompts)
    int4 = LLM(folder, dtype="bfloat16", cpu_isa="avx2", quantization="int4", attention_backend="cpu", **args)
    int4_err = _bf16_error(int4, int4_fp32, prompts)
    assert 0 < int4_err <= 1.5 * int4_torch + 0.02, (int4_err, int4_torch)
    kernels.use_cpu_isa("auto")


# ---- the NEON build under qemu ----

def _cases(ops):
    """(kernel, args, inputs, what the torch op of the AVX2 set gives): one case of each portable kernel."""
    from tokenmill.layers.rotary import RotaryEmbedding

    x, w, res = _rand(3, 72, seed=1), _rand(72, seed=2), _rand(3, 72, seed=3)
    plain, x2, r2 = torch.empty_like(x), x.clone(), res.clone()
    ops.rms_norm(plain, x, w, 1e-5)
    ops.add_rms_norm(x2, r2, w, 1e-5)
    yield "norm", [3, 72], {"x": x, "w": w, "residual": res}, torch.cat([plain, x2, r2])
    g = _rand(2, 96, seed=4, scale=4.0)
    silu = torch.empty(2, 48, dtype=torch.bfloat16)
    ops.silu_and_mul(silu, g)
    yield "silu", [2, 48], {"x": g}, silu
    rope = RotaryEmbedding(64, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    qkv = _rand(1, 3 * 64, seed=5)
    q, cache = torch.empty(1, 1, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 1, 1, 64, dtype=torch.bfloat16)
    ops.rope_and_cache(q, qkv.clone(), torch.tensor([37]), rope.cos, rope.sin, cache[0], cache[1], torch.tensor([0]),
                       1, 1)
    yield "rope", [1, 64, 37], {"x": qkv[:, :64], "cos": rope.cos, "sin": rope.sin}, q.view(1, 64)
    logits = _rand(2, 300, seed=6)
    logits[1, 7] = logits[1, 200] = 9.0
    yield "argmax", [2, 300], {"x": logits}, ops.argmax_rows(logits)
    wt, b, xm = _rand(64, 96, seed=7), torch.randn(64), _rand(5, 96, seed=8)
    tiles = ops.pack_tiles(wt)
    for gated in (0, 1):
        yield "gemm", [5, 96, 64, gated], {"x": xm, "packed": tiles, "bias": b}, ops.vec_gemm(xm, tiles, b, 64,
                                                                                            bool(gated))
    for bits, group in QUANT_CASES:
        qw = _quantized(bits, group)
        qp, scale, mn = pack_for_kernels(qw)
        n, k = qw.q.shape
        xq = _rand(5, k, seed=bits + group)
        inputs = {"x": xq, "q": qp, "scale": scale, "min": mn if mn is not None else torch.zeros(0), "bias": b}
        yield "quant", [5, k, n, bits, group], inputs, ops.quant_gemm(xq, qp, scale, mn, b, bits, group, n)
        panels = torch.cat([ops.quant_dequantize_t(qp, scale, mn, bits, group, n, k, i, i + 1).T.contiguous()
                            .view(16, k // 2, 2).permute(1, 0, 2).flatten() for i in range(n // 16)])
        yield "dequant", [k, n, bits, group], inputs, panels


def _run(binary: list[str], ops, tmp: Path) -> int:
    """Every case through the harness; each output must be the torch op's, bit for bit. Returns the count."""
    count = 0
    for i, (kernel, args, inputs, want) in enumerate(_cases(ops)):
        case = tmp / f"{kernel}{i}"
        case.mkdir()
        (case / "args.txt").write_text(" ".join(map(str, args)))
        for name, t in inputs.items():
            t.contiguous().view(-1).view(torch.uint8).numpy().tofile(case / f"{name}.bin")
        subprocess.run(binary + [kernel, str(case)], check=True, capture_output=True, timeout=60)
        got = np.fromfile(case / "out.bin", dtype=np.uint8)
        assert got.tobytes() == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), (kernel, args)
        count += 1
    return count


def test_harness_on_x86_gives_the_avx2_ops_bits(tmp_path):
    """The harness itself, built for this CPU: its plumbing (files in, the kernel, a file out) is what the qemu
    test relies on."""
    ops, _ = _sets()
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    binary = tmp_path / "harness_x86"
    subprocess.run(["g++", "-O2", "-mavx2", "-mfma", "-mf16c", "-o", str(binary), str(HARNESS)], check=True,
                   timeout=120)
    assert _run([str(binary)], ops, tmp_path) >= 10


@pytest.mark.parametrize("march", ["armv8.2-a+dotprod", "armv8-a"])
def test_neon_kernels_under_qemu_give_the_avx2_bits(tmp_path, march):
    """The NEON build (with sdot, and plain NEON without it), cross-compiled and run under qemu-aarch64: every
    kernel's output equals the AVX2 kernels' bit for bit (the same fused multiply-adds, roundings and exact
    integer sums), so it equals the AVX-512 kernels' where those define the bits."""
    ops, _ = _sets()
    compiler, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static") or \
        shutil.which("qemu-aarch64")
    if compiler is None or qemu is None:
        pytest.skip("needs Debian's g++-aarch64-linux-gnu and qemu-user-static (make setup installs them)")
    binary = tmp_path / "harness_neon"
    subprocess.run([compiler, "-O2", f"-march={march}", "-static", "-o", str(binary), str(HARNESS)], check=True,
                   timeout=180)
    banner = subprocess.run([qemu, str(binary), "none", str(tmp_path)], capture_output=True, text=True)
    assert banner.stdout.startswith("neon") and ("+dotprod" in banner.stdout) == ("dotprod" in march)
    assert _run([qemu, str(binary)], ops, tmp_path) >= 10
