"""The Triton kernels of the GPU path (kernels/gpu), run on the CPU in Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU): the quantized matmul against the weight's reference dequantization,
the fused temperature sampler against an fp64 inverse-CDF draw with the same uniforms. (Paged decode attention
is in test_attention_backends.py, as the triton backend.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.quant.tensor import QuantizedWeight

pytest.importorskip("triton")


def _weight(bits: int, n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        mins = None
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        mins = (torch.randn(n, k // group, generator=g) * 0.05).half().float()
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    return QuantizedWeight(q, scale, mins, bits, group)


@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 32), (4, 128)])
@pytest.mark.parametrize("rows", [1, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_matmul_equals_the_dequantized_weight(bits, group, rows, bias):
    from tokenmill.kernels.gpu.quant_matmul import GpuQuantWeight

    n, k = 80, 256   # (80: a partial tile of outputs)
    qw = _weight(bits, n, k, group, seed=bits + group + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b = torch.randn(n) if bias else None
    gw = GpuQuantWeight.pack(qw, "cpu")
    assert gw.nbytes < n * k * 2 * (0.6 if bits == 8 else 0.35)   # kept quantized: well under bf16's bytes
    torch.testing.assert_close(gw.matmul(x, b), F.linear(x, qw.dequantize(), b), atol=2e-4, rtol=1e-4)


def test_quant_matmul_refuses_groups_it_cannot_tile():
    from tokenmill.kernels.gpu.quant_matmul import GpuQuantWeight

    with pytest.raises(ValueError, match="groups"):
        GpuQuantWeight.pack(_weight(8, 16, 64, 16, 0), "cpu")


def _reference_draw(logits: torch.Tensor, temp: torch.Tensor, u: torch.Tensor):
    """fp64 inverse CDF: each row's token, its targets and the running sums (for the tie check)."""
    p = torch.exp((logits.double() / temp[:, None].double()) - (logits.double() / temp[:, None].double()).amax(
        -1, keepdim=True))
    cdf = p.cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0], target[:, 0], cdf


def test_fused_sampler_draws_what_the_inverse_cdf_draws():
    from tokenmill.kernels.gpu.sampling import sample_with_temperature

    g = torch.Generator().manual_seed(0)
    rows, vocab = 48, 5000   # (5,000: a partial last chunk of the vocabulary)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[::3, ::2] = float("-inf")   # masked tokens (a grammar, min_tokens) are never drawn
    temp = torch.rand(rows, generator=g) * 1.5 + 0.05
    u = torch.rand(rows, generator=g)
    ours = sample_with_temperature(logits, temp, u)
    ref, target, cdf = _reference_draw(logits, temp, u)
    assert not torch.isneginf(logits[torch.arange(rows), ours]).any()
    for row in torch.nonzero(ours != ref)[:, 0].tolist():   # only where the target sits on a boundary
        a, b = sorted((int(ours[row]), int(ref[row])))
        boundary = float(cdf[row, a])
        assert b == a + 1 or torch.all(cdf[row, a:b] == boundary), f"row {row}: {ours[row]} vs {ref[row]}"
        assert abs(float(target[row]) - boundary) < 1e-5 * float(cdf[row, -1]), f"row {row} is not a tie"
    assert (ours == ref).float().mean() > 0.9


def test_fused_sampler_follows_the_temperature():
    """A cold row draws its best token; a hot one spreads over the vocabulary."""
    from tokenmill.kernels.gpu.sampling import sample_with_temperature

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 300, generator=g)
    logits[0, 7] = logits.max() + 0.1   # the best by a margin that 1e-3 makes a factor of e^100
    logits = logits.repeat(200, 1)
    u = torch.rand(200, generator=g)
    cold = sample_with_temperature(logits, torch.full((200,), 1e-3), u)
    hot = sample_with_temperature(logits, torch.full((200,), 50.0), u)
    assert set(cold.tolist()) == {7}
    assert len(set(hot.tolist())) > 100
