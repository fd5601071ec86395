"""Every attention backend agrees with torch_ref on decode, prefill, chunked prefill and prefix hits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.ops import write_kv
from tokenmill.attention.registry import get_backend as _get_backend


def get_backend(name: str, device: str):
    """A registered backend; "cpu_avx512" is the CPU backend with its bf16 decode scores kept off AMX (the path of
    CPUs without it, tested on every CPU)."""
    if name == "triton":
        pytest.importorskip("triton")
    if name != "cpu_avx512":
        return _get_backend(name, device)
    backend = _get_backend("cpu", device)
    backend.decode_amx = False
    return backend


def _case(q_lens, ctx_lens, block_size, hq, hkv, d, dtype, seed=0):
    """A cache with random past K/V per request, and new tokens already written at their slots."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 4
    perm = torch.randperm(num_blocks - 1, generator=g) + 1        # scattered blocks, none is block 0
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(q_lens), max(blocks_per), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    return _new_tokens(table, seq_lens, q_lens, cache, hq, g)


def _new_tokens(table, seq_lens, q_lens, cache, hq, g):
    """The step's metadata and random q/k/v for the last q_lens[i] tokens of each request, K/V written."""
    block_size, hkv, d = cache.shape[2], cache.shape[3], cache.shape[4]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    row = np.repeat(np.arange(len(q_lens)), q_lens)
    pos = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    slots = table[row, pos // block_size].numpy().astype(np.int64) * block_size + pos % block_size
    md = AttentionMetadata(torch.from_numpy(slots), table, torch.from_numpy(qsl), torch.tensor(seq_lens), qsl,
                           np.array(seq_lens), max(q_lens), max(seq_lens))
    t = int(qsl[-1])
    q = torch.randn(t, hq, d, generator=g).to(cache.dtype)
    k = torch.randn(t, hkv, d, generator=g).to(cache.dtype)
    v = torch.randn(t, hkv, d, generator=g).to(cache.dtype)
    write_kv(cache, k, v, md.slot_mapping)
    return q, k, v, cache, md


CASES = {
    "decode": ([1, 1, 1, 1], [5, 40, 16, 100]),
    "prefill": ([7, 33, 16], [0, 0, 0]),
    "chunked_and_prefix": ([12, 1, 20, 1], [16, 64, 32, 3]),
    "one_token_prompt": ([1], [0]),
    # past 512 keys the kernel splits a decoded token's keys into parts and merges them (flash-decoding); the
    # 8-token chunk crosses that length (tokens 510-517), the 3-token one runs at 1,031-1,033 (three parts)
    "long_decodes": ([1, 1, 3, 8, 1], [1500, 600, 1030, 509, 40]),
}


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size, hq, hkv", [(16, 9, 3), (8, 4, 4), (32, 8, 2)])
def test_backend_matches_reference(backend, case, block_size, hq, hkv):
    q_lens, ctx = CASES[case]
    q, k, v, cache, md = _case(q_lens, ctx, block_size, hq, hkv, 64, torch.float32)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
    out = get_backend(backend, "cpu").forward(q, k, v, cache, md, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu", "cpu_avx512", "triton"])
def test_backend_bf16_close_to_reference(backend):
    q, k, v, cache, md = _case([1, 9, 1, 40, 1], [30, 7, 70, 0, 2000], 16, 9, 3, 64, torch.bfloat16)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
    out = get_backend(backend, "cpu").forward(q, k, v, cache, md, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu"])
def test_prompts_whose_k_and_v_have_different_strides(backend):
    """The model's unfused path (qk-norm models, a cache whose scales are being calibrated) passes rotated K as
    a tensor of its own and V as a view into the qkv output: the two have different token strides. The native
    prompt kernels take one stride for both (a bf16 fp8-cache engine died here at its warm-up)."""
    q, k, v, cache, md = _case([7, 40], [0, 0], 16, 9, 3, 64, torch.bfloat16)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    v_view = qkv[:, (9 + 3) * 64:].view(-1, 3, 64)
    assert k.stride(0) != v_view.stride(0)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
    out = get_backend(backend, "cpu").forward(q, k, v_view, cache, md, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


_WINDOW_SHAPES = [(16, 9, 3, 64), (8, 4, 4, 64), (16, 4, 2, 32)]


@pytest.mark.parametrize("backend, block_size, hq, hkv, d",
                         [(b, *shape) for b in ("torch_sdpa", "cpu") for shape in _WINDOW_SHAPES]
                         + [("triton", 16, 4, 2, 32)])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_matches_reference(backend, case, block_size, hq, hkv, d, window):
    """A window inside a block, of one block, and across blocks; (16, 9, 3, 64) takes the kernel's decode path.
    The triton kernel (interpreted here, ~0.1 s a case) takes its windows on one shape: its head and block sizes
    are in test_backend_matches_reference."""
    q_lens, ctx = CASES[case]
    q, k, v, cache, md = _case(q_lens, ctx, block_size, hq, hkv, d, torch.float32)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125, window=window)
    out = get_backend(backend, "cpu").forward(q, k, v, cache, md, 0.125, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    if window < md.max_seq_len:  # the window changes the answer: the reference's masking does something
        full = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
        assert not torch.allclose(full, ref, atol=1e-3)


@pytest.mark.parametrize("backend", ["cpu", "cpu_avx512"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_split_decode_gives_a_token_the_same_bits_in_any_step(backend, kv_dtype):
    """A long context's token, attended in parts and merged: the same bits whether it is decoded alone, with
    other requests, or computed as the last of a chunk (speculation and batching cannot change an answer)."""
    q, k, v, cache, md = _case([8, 1], [1000, 700], 16, 9, 3, 64, torch.bfloat16, seed=3)
    scales = (1.0, 1.0) if kv_dtype == torch.bfloat16 else (0.5, 2.0)   # (a quantized cache's scales)
    cache = cache.to(kv_dtype)
    cpu = get_backend(backend, "cpu")
    together = cpu.forward(q, k, v, cache, md, 0.125, *scales)
    qsl = np.array([0, 1], dtype=np.int64)
    alone = AttentionMetadata(md.slot_mapping[7:8], md.block_table[:1], torch.from_numpy(qsl), torch.tensor([1008]),
                              qsl, np.array([1008]), 1, 1008)
    out = cpu.forward(q[7:8], k[7:8], v[7:8], cache, alone, 0.125, *scales)
    assert torch.equal(out[0], together[7])
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125, *scales)
    torch.testing.assert_close(together.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype, scales", [(torch.float8_e4m3fn, (0.5, 2.0)), (torch.int8, (0.05, 0.05))])
@pytest.mark.parametrize("hkv", [2, 3, 4])
def test_many_decodes_over_a_one_byte_cache_give_each_token_its_bits_alone(kv_dtype, scales, hkv):
    """Twenty decodes over an fp8 or int8 cache run a token (all its KV heads) to a task; a token alone runs a
    head to a task: the same bits either way, and the reference's answer."""
    ctx = [5 + 23 * i for i in range(20)]          # up to 442 tokens: none split into parts
    q, k, v, cache, md = _case([1] * 20, ctx, 16, 3 * hkv, hkv, 64, torch.bfloat16, seed=5)
    cache = cache.to(kv_dtype)
    cpu = get_backend("cpu", "cpu")
    together = cpu.forward(q, k, v, cache, md, 0.125, *scales)
    for i, c in enumerate(ctx):
        qsl = np.array([0, 1], dtype=np.int64)
        alone = AttentionMetadata(md.slot_mapping[i:i + 1], md.block_table[i:i + 1], torch.from_numpy(qsl),
                                  torch.tensor([c + 1]), qsl, np.array([c + 1]), 1, c + 1)
        out = cpu.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, alone, 0.125, *scales)
        assert torch.equal(out[0], together[i]), i
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125, *scales)
    torch.testing.assert_close(together.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_reads_the_cache_by_its_strides(case, kv_dtype):
    """The paged kernel addresses a KV head by the cache's head stride, not by head_dim: a cache laid out head by
    head within each block (given as the [2, N, block_size, Hkv, D] view of that memory) gives the same bits as
    the token-major one, on the decode path (split parts and one-byte heads together included) and off it."""
    q_lens, ctx = CASES[case]
    q, k, v, cache, md = _case(q_lens * 5, ctx * 5, 16, 9, 3, 64, torch.bfloat16, seed=11)
    cache = cache.to(kv_dtype)
    head_major = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    assert torch.equal(head_major, cache) and head_major.stride(3) != 64
    cpu = get_backend("cpu", "cpu")
    scales = (1.0, 1.0) if kv_dtype == torch.bfloat16 else (0.5, 2.0)
    md_head = dataclasses.replace(md, backend_plan={})
    torch.testing.assert_close(cpu.forward(q, k, v, head_major, md_head, 0.125, *scales),
                               cpu.forward(q, k, v, cache, md, 0.125, *scales), atol=0, rtol=0)


def test_reference_reads_what_was_written():
    """torch_ref on a one-token context returns exactly v: the write and the gather address the same slot."""
    q, k, v, cache, md = _case([1], [0], 16, 4, 2, 8, torch.float32)
    out = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 1.0)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention_backend"):
        get_backend("nope", "cpu")


def _shared_prefix_case(tails, q_lens, prefix_blocks, block_size, hq, hkv, d, dtype, in_order=False, seed=0):
    """Requests whose block tables start with the same `prefix_blocks` blocks (scattered, or in_order: 1, 2,
    3, ...), then `tails[i]` tokens in their own blocks, the last `q_lens[i]` of which are new in this step."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [prefix_blocks * block_size + t for t in tails]
    own = [-(-t // block_size) for t in tails]
    num_blocks = prefix_blocks + sum(own) + 2
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    if in_order:
        perm = list(range(1, prefix_blocks + 1)) + [b for b in perm if b > prefix_blocks]
    shared, rest = perm[:prefix_blocks], perm[prefix_blocks:]
    table = torch.zeros(len(tails), prefix_blocks + max(own), dtype=torch.int32)
    for i, nb in enumerate(own):
        table[i, : prefix_blocks + nb] = torch.tensor(shared + rest[:nb])
        rest = rest[nb:]
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    return _new_tokens(table, seq_lens, q_lens, cache, hq, g)


SHARED_PREFIX_CASES = {
    "decodes": ([1, 5, 16, 17, 40, 3, 30, 9, 2, 64], [1] * 10),
    "decodes_and_chunks": ([33, 5, 16, 17, 40, 3, 30, 9, 2, 64, 20], [33, 1, 16, 1, 20, 3, 1, 9, 1, 1, 7]),
    # the long chunk is attended apart (SDPA over the gathered cache): the cascade takes only some tokens
    "decodes_and_a_long_chunk": ([1, 5, 16, 17, 40, 3, 30, 9, 2, 200], [1] * 9 + [150]),
    # tails past 512 tokens: the kernel's share is split into parts (skipping the prefix's blocks) and merged
    "long_tails": ([1, 5, 16, 17, 40, 3, 30, 9, 2, 700, 900], [1] * 10 + [4]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 32)])
@pytest.mark.parametrize("case", sorted(SHARED_PREFIX_CASES))
@pytest.mark.parametrize("in_order", [False, True])
def test_shared_prefix_matches_reference(dtype, hq, hkv, d, case, in_order):
    """The cascade path (prefix by flash attention, tails by the kernel, merged by log-sum-exp) is taken
    and agrees with attending each request on its own, for decodes and for chunks after the prefix, with
    the prefix's blocks gathered (scattered) or viewed in place (in order)."""
    tails, q_lens = SHARED_PREFIX_CASES[case]
    q, k, v, cache, md = _shared_prefix_case(tails, q_lens, 20, 16, hq, hkv, d, dtype, in_order)
    ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125)
    out = get_backend("cpu", "cpu").forward(q, k, v, cache, md, 0.125)
    prefix = md.backend_plan["cpu"].prefix
    assert prefix.num_blocks == 20 and (prefix.first_block is not None) == in_order
    assert prefix.all_tokens == (case != "decodes_and_a_long_chunk")
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("case", sorted(SHARED_PREFIX_CASES))
def test_sliding_window_over_a_shared_prefix(case):
    """A windowed layer does not attend a shared prefix that its tokens partly cannot see: no cascade plan for it,
    while a full-attention layer of the same step keeps its cascade."""
    tails, q_lens = SHARED_PREFIX_CASES[case]
    q, k, v, cache, md = _shared_prefix_case(tails, q_lens, 20, 16, 9, 3, 64, torch.float32)
    cpu = get_backend("cpu", "cpu")
    for window in (7, 300):
        ref = get_backend("torch_ref", "cpu").forward(q, k, v, cache, md, 0.125, window=window)
        out = cpu.forward(q, k, v, cache, md, 0.125, window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert md.backend_plan["cpu/window"].prefix is None
    cpu.forward(q, k, v, cache, md, 0.125)
    assert md.backend_plan["cpu"].prefix is not None
