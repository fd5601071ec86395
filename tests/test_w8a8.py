"""W8A8: the kernel's int8 x int8 product equals per-token x per-channel quantization done by hand; SmoothQuant's
folding leaves the float model's function unchanged; `tokenmill quantize` saves the maxima the engine reads."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.tensor import quantize_int8
from tokenmill.layers.quant.w8a8 import (
    W8A8_MIN_ROWS,
    W8A8Kernel,
    apply_smoothing,
    collect_activation_maxima,
    smoothing_path,
)

PROMPT = [17, 923, 4412, 88, 301, 77, 2049, 5, 640, 12]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_equals_quantizing_by_hand(dtype, native, monkeypatch):
    """Both paths: the one-pass native quantize and scale kernels, and torch's operations."""
    import tokenmill.layers.quant.w8a8 as w8a8

    monkeypatch.setattr(w8a8, "USE_NATIVE_OPS", native)
    if native and not w8a8.native_ops():
        pytest.skip("the native kernels are not built here")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    x = (torch.randn(W8A8_MIN_ROWS + 40, 64, generator=g) * torch.linspace(0.1, 8, 64)).to(dtype)
    qw = quantize_int8(w)
    kernel = W8A8Kernel(qw, b, dtype)
    xf = x.double()
    sx = xf.abs().amax(1, keepdim=True) / 127
    xq = torch.round(xf / sx).clamp(-127, 127)
    ref = (xq @ qw.q.double().t()) * sx * qw.scale.double().reshape(1, -1) + b.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernel(x).double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    small = x[:W8A8_MIN_ROWS]   # few rows (decode): the weight-only kernel, activations unquantized
    torch.testing.assert_close(kernel(small), QuantLinearKernel(qw, b, dtype)(small))


def test_smoothing_leaves_the_float_model_unchanged(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", enforce_eager=True, max_num_seqs=2)
    maxima = collect_activation_maxima(llm, ["The kettle had been whistling for a while before anyone noticed."])
    assert len(maxima) == 4 * 2   # q/k/v, gate/up, o and down of each of the 2 layers
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    before = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    model = llm.engine_core.executor.runner.model
    w = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    assert apply_smoothing(model, maxima) == 8
    assert not torch.allclose(w, model.model.layers[0].self_attn.qkv_proj.weight)   # (the weights did move)
    model.process_weights_after_loading()
    after = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == before.token_ids
    for a, b, t in zip(before.logprobs, after.logprobs, before.token_ids):
        assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_quantize_command_saves_the_maxima_the_engine_reads(tiny_model_dir, tmp_path, caplog):
    import shutil

    from tokenmill.cli.main import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    assert main(["quantize", str(folder)]) == 0
    path = smoothing_path(str(folder))
    assert path == folder / "tokenmill" / "w8a8_smoothing.safetensors" and path.exists()
    with caplog.at_level("INFO"):
        llm = LLM(str(folder), quantization="w8a8", max_num_seqs=2)
    assert "SmoothQuant factors for 8 layers" in caplog.text
    layers = llm.engine_core.executor.runner.model.model.layers[0]
    assert isinstance(layers.self_attn.qkv_proj.kernel, W8A8Kernel)
    assert type(layers.mlp.down_proj.kernel) is QuantLinearKernel   # (down_proj: weight-only int8)
    out = llm.generate({"prompt_token_ids": PROMPT * 40}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4   # a prompt of 400 rows: the int8 x int8 path
