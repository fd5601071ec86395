"""Checkpoints quantized by other tools: GPTQ (4 and 8 bits, groups, act-order), AWQ (GEMM layout),
compressed-tensors (int8 channels, packed int4 groups) and FP8 (per tensor, per 128x128 block). Each tiny random
Llama is written here in its format's documented layout, from weights quantized here; transformers runs the
same model with those weights dequantized by the format's formula; greedy tokens must be equal (fp32), and in
bf16 the quantized layers must run on the native kernels, kept quantized."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_greedy_matches, hf_greedy
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [17, 923, 4412, 88, 301, 77, 2049, 5]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_along_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] small unsigned ints -> int32 [R / per, C]: value j of word i is row i * per + j, low bits first."""
    per = 32 // bits
    v = v.to(torch.int64).view(v.shape[0] // per, per, v.shape[1])
    word = sum(v[:, j] << (bits * j) for j in range(per))
    return (word - ((word >> 31) << 32)).to(torch.int32)   # (as two's complement int32)


def pack_along_cols(v: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_along_rows(v.t().contiguous(), bits).t().contiguous()


def asym_groups(w: torch.Tensor, bits: int, group: int):
    """Asymmetric grouped quantization of w [N, K]: q [N, K], scale and zero [N, K / group] (zero >= 1)."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / top).clamp(min=1e-6).half().float()
    zero = torch.round(-lo / scale).clamp(1, top)
    q = torch.round(g / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, top)
    return q.view(n, k), scale, zero


def dequant(q, scale, zero, group):
    n, k = q.shape
    return ((q.view(n, k // group, group) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).view(n, k)


def write_gptq(w, bits=4, group=32, act_order=False):
    n, k = w.shape
    if act_order:   # column k quantized in group g_idx[k] (a permutation of the natural groups)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(n + k))
        q, scale, zero = asym_groups(w[:, perm], bits, group)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        inv = torch.argsort(perm)
        q = q[:, inv]
        deq = (q - zero[:, g_idx.long()]) * scale[:, g_idx.long()]
    else:
        q, scale, zero = asym_groups(w, bits, group)
        g_idx = (torch.arange(k) // group).to(torch.int32)
        deq = dequant(q, scale, zero, group)
    parts = {"qweight": pack_along_rows(q.t().contiguous().to(torch.int64), bits),
             "qzeros": pack_along_cols((zero.t() - 1).to(torch.int64), bits),   # (v1: zero - 1)
             "scales": scale.t().contiguous().half(), "g_idx": g_idx}
    return parts, deq


def write_awq(w, group=32):
    q, scale, zero = asym_groups(w, 4, group)

    def pack(v_kn):   # [R, N] -> [R, N / 8], nibble i of word c holding column 8c + AWQ_ORDER[i]
        r, n = v_kn.shape
        v = v_kn.to(torch.int64).view(r, n // 8, 8)[:, :, AWQ_ORDER]
        word = sum(v[:, :, i] << (4 * i) for i in range(8))
        return (word - ((word >> 31) << 32)).to(torch.int32)

    return {"qweight": pack(q.t()), "qzeros": pack(zero.t()), "scales": scale.t().contiguous().half()}, \
        dequant(q, scale, zero, group)


def write_ct_int8(w):
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def write_ct_int4(w, group=32):
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-6)
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7).view(n, k)
    return {"weight_packed": pack_along_cols((q + 8).to(torch.int64), 4), "weight_scale": scale,
            "weight_shape": torch.tensor([n, k])}, (q.view(n, k // group, group) * scale.unsqueeze(-1)).view(n, k)


def write_fp8(w, block=False):
    if block:   # one scale per 128 x 128 block (weight_scale_inv, as DeepSeek's and Qwen's fp8 checkpoints)
        n, k = w.shape
        s = torch.full((-(-n // 128), -(-k // 128)), float(w.abs().max()) / 448)
        q = (w / s[0, 0]).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": s}, q.float() * s[0, 0]
    s = w.abs().max() / 448
    q = (w / s).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s.reshape(())}, q.float() * s


FORMATS = {
    "gptq4": (lambda w: write_gptq(w), {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                         "sym": False}),
    "gptq4-act-order": (lambda w: write_gptq(w, act_order=True), {"quant_method": "gptq", "bits": 4,
                                                                   "group_size": 32, "desc_act": True}),
    "gptq8": (lambda w: write_gptq(w, bits=8), {"quant_method": "gptq", "bits": 8, "group_size": 32}),
    "awq": (write_awq, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "ct-int8": (write_ct_int8, {"quant_method": "compressed-tensors", "format": "int-quantized"}),
    "ct-int4": (write_ct_int4, {"quant_method": "compressed-tensors", "format": "pack-quantized"}),
    "fp8": (write_fp8, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "fp8-block": (lambda w: write_fp8(w, block=True), {"quant_method": "fp8", "weight_block_size": [128, 128]}),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """format -> (its folder, a transformers model holding the dequantized weights), each built when first asked."""
    import transformers

    base = tiny_model_dir("llama")
    out = {}

    def build(name: str):
        if name in out:
            return out[name]
        write, qcfg = FORMATS[name]
        folder = tmp_path_factory.mktemp(f"quant-{name}")
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tensors = {}
        for key, t in model.state_dict().items():
            if key.rsplit(".", 2)[-2] in PROJ and key.endswith(".weight"):
                parts, deq = write(t.float())
                prefix = key[:-len(".weight")]
                tensors.update({f"{prefix}.{p}": v.contiguous() for p, v in parts.items()})
                t.copy_(deq)
            else:
                tensors[key] = t.contiguous()
        save_file(tensors, str(folder / "model.safetensors"))
        cfg = json.loads((base / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
        for f in base.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                (folder / f.name).write_bytes(f.read_bytes())
        out[name] = (folder, model.eval())
        return out[name]

    return build


# make test: one of each kind (act-order, groups with zero points, AWQ's order, packed int4, fp8 blocks)
FAST = ("gptq4-act-order", "gptq4", "awq", "ct-int4", "fp8-block")


@pytest.mark.parametrize("fmt", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_greedy_equals_transformers_on_the_dequantized_weights(checkpoints, fmt):
    folder, reference = checkpoints(fmt)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2)
    assert llm.config.model_config.quantization == FORMATS[fmt][1]["quant_method"]
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=16, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    ref, logits = hf_greedy(reference, PROMPT, 16)
    assert_greedy_matches(out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)], ref, logits)


@pytest.mark.parametrize("fmt,bits", [("gptq4", 4), ("ct-int8", 8)])
def test_quantized_layers_stay_quantized(checkpoints, fmt, bits):
    """In the model dtype the layers keep the checkpoint's integers (the kernels' own packing)."""
    from tokenmill.layers.quant.kernel import QuantLinearKernel

    llm = LLM(str(checkpoints(fmt)[0]), dtype="bfloat16", max_num_seqs=2)
    layer = llm.engine_core.executor.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.kernel, QuantLinearKernel) and layer.kernel.bits == bits
    assert llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints, tiny_model_dir):
    with pytest.raises(ValueError, match="already quantized with gptq"):
        LLM(str(checkpoints("gptq4")[0]), quantization="int8")
    with pytest.raises(ValueError, match="needs a checkpoint quantized that way"):
        LLM(str(tiny_model_dir("llama")), quantization="awq")
