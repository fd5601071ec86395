"""Checkpoints quantized by other tools, read as they are and kept quantized: GPTQ (AutoGPTQ / GPTQModel's
layout), AWQ (AutoAWQ's GEMM layout), compressed-tensors (llm-compressor: int8 channel weights, packed int4
groups, fp8) and FP8 (transformers' and vLLM's e4m3 weights with scales).

Each quantized linear's tensors (qweight, qzeros, scales, g_idx; weight_packed, weight_scale; ...) are gathered
and turned into one QuantizedWeight (w = scale * q + min, the form the native int8 and int4 kernels take) under the
layer's `weight` name, so the model loads it as it loads a GGUF block tensor. What the kernels cannot hold value
for value is dequantized into floats instead, and said so: GPTQ's act-order (a per-column group index), 8-bit
weights with zero points, and fp8 (this CPU has no fp8 arithmetic: e4m3 values times their scales, in the model
dtype).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenmill.layers.quant.tensor import QuantizedWeight
from tokenmill.utils import init_logger

logger = init_logger(__name__)

_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
          "compressed-tensors": ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                                 "input_scale", "weight_g_idx"),
          "fp8": ("weight_scale", "weight_scale_inv", "input_scale")}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ word holds output column 8 * word + _AWQ_ORDER[i]


def prequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], qcfg: dict,
                         dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized layer's parts replaced by one `<layer>.weight`: a
    QuantizedWeight, or floats where the kernels cannot hold the format as it is."""
    method = qcfg["quant_method"]
    parts = _PARTS[method]
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        float_weight = leaf == "weight" and (t.dtype in _FP8 or t.dtype == torch.int8)
        if leaf in parts or float_weight:
            groups.setdefault(prefix, {})[leaf] = t
        else:
            yield name, t
    fallbacks = 0
    for prefix, g in groups.items():
        if set(g) <= {"input_scale"}:
            continue   # (an activation scale of a layer kept in floats: activations run unquantized)
        w = _assemble(method, qcfg, g, prefix)
        if not isinstance(w, QuantizedWeight):
            fallbacks += 1
            w = w.to(dtype)
        yield f"{prefix}.weight", w
    if fallbacks:
        logger.info("%s checkpoint: %d layers dequantized to %s (%s)", method, fallbacks, str(dtype).split(".")[-1],
                    "fp8 has no arithmetic here" if method == "fp8" else "the kernels cannot hold them as they are")


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _assemble(method: str, qcfg: dict, g: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | QuantizedWeight:
    if method == "gptq":
        return _gptq(qcfg, g, prefix)
    if method == "awq":
        return _awq(qcfg, g)
    if method == "fp8" or g.get("weight", torch.empty(0)).dtype in _FP8:
        return _fp8(g, prefix)
    return _compressed(qcfg, g, prefix)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words packed along dim 0 (value j of word i is row i * per + j, low bits first) -> [rows, cols]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    v = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return v.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words packed along dim 1 (value j of word i is column i * per + j, low bits first)."""
    return unpack_rows(packed.t().contiguous(), bits).t().contiguous()


def _grouped(q_nk: torch.Tensor, scale_gn: torch.Tensor, zero_gn: torch.Tensor | None, bits: int,
             group: int) -> torch.Tensor | QuantizedWeight:
    """w[n, k] = scale[k // group, n] * (q[n, k] - zero[k // group, n]) as the kernels' QuantizedWeight (4 bits:
    q as it is, min = -scale * zero; 8 bits: symmetric only, q - 128), or as floats where they cannot hold it."""
    scale = scale_gn.float().t().contiguous()
    zero = None if zero_gn is None else zero_gn.float().t().contiguous()
    if bits == 4:
        mn = -scale * zero if zero is not None else -8.0 * scale
        return QuantizedWeight(q_nk.to(torch.int8), scale, mn, 4, group)
    if bits == 8 and (zero is None or bool((zero == 128).all())):
        return QuantizedWeight((q_nk - 128).to(torch.int8), scale, None, 8, group)
    n, k = q_nk.shape
    z = zero if zero is not None else torch.full_like(scale, float(1 << (bits - 1)))
    return ((q_nk.float().view(n, k // group, group) - z.unsqueeze(-1)) * scale.unsqueeze(-1)).view(n, k)


def _gptq(qcfg: dict, g: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | QuantizedWeight:
    bits = int(qcfg.get("bits", 4))
    q = unpack_rows(g["qweight"], bits)                       # [K, N]
    k, n = q.shape
    group = int(qcfg.get("group_size", -1))
    group = k if group in (-1, 0) else group
    zero = unpack_cols(g["qzeros"], bits)[:, :n].float()       # [K / group, N]
    if qcfg.get("checkpoint_format", "gptq") != "gptq_v2":
        zero = zero + 1                                         # (GPTQ v1 stores zero - 1)
    g_idx = g.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        # act-order: column k belongs to group g_idx[k], not k // group; dequantized column by column
        idx = g_idx.long()
        return ((q.float() - zero[idx]) * g["scales"].float()[idx]).t().contiguous()
    return _grouped(q.t().contiguous(), g["scales"], zero, bits, group)


def _awq(qcfg: dict, g: dict[str, torch.Tensor]) -> torch.Tensor | QuantizedWeight:
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    if bits != 4 or str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise ValueError("AWQ: only 4-bit GEMM-layout checkpoints are read")
    order = torch.tensor(_AWQ_ORDER)
    inverse = torch.argsort(order)

    def unpack(t: torch.Tensor) -> torch.Tensor:   # [rows, N / 8] words -> [rows, N] in column order
        v = unpack_cols(t, 4).view(t.shape[0], -1, 8)
        return v[:, :, inverse].reshape(t.shape[0], -1)

    q, zero = unpack(g["qweight"]), unpack(g["qzeros"])        # [K, N], [K / group, N]
    k = q.shape[0]
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    group = k if group in (-1, 0) else group
    if not qcfg.get("zero_point", True):
        zero = None
    return _grouped(q.t().contiguous(), g["scales"], zero, 4, group)


def _compressed(qcfg: dict, g: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | QuantizedWeight:
    """llm-compressor's int-quantized (int8 weight, a scale per channel or group) and pack-quantized (int4 values
    + 8, eight to an int32 along the input) layouts."""
    scale = g["weight_scale"].float()
    zp = g.get("weight_zero_point")
    if "weight_packed" in g:
        n, k = (int(v) for v in g["weight_shape"].tolist())
        q = unpack_cols(g["weight_packed"], 4)[:, :k]            # [N, K], values + 8
        zero = None if zp is None else zp.float() + 8
        return _grouped(q, scale.reshape(n, -1).t(), None if zero is None else zero.reshape(n, -1).t(), 4,
                        k // scale.reshape(n, -1).shape[1])
    w = g["weight"]
    if w.dtype != torch.int8:
        raise ValueError(f"{prefix}: a compressed-tensors weight of dtype {w.dtype} is not read")
    n, k = w.shape
    scale = scale.reshape(n, -1)
    if zp is not None and bool(zp.ne(0).any()):
        return ((w.float().view(n, scale.shape[1], -1) - zp.float().reshape(n, -1, 1)) *
                scale.unsqueeze(-1)).view(n, k)
    return _grouped((w.to(torch.int16) + 128), scale.t(), None, 8, k // scale.shape[1])


def _fp8(g: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """e4m3 weights times their scale: per tensor, per output channel, or per [128 x 128] block
    (weight_scale_inv)."""
    w = g["weight"].float()
    n, k = w.shape
    if "weight_scale_inv" in g:
        s = g["weight_scale_inv"].float()
        bn, bk = -(-n // s.shape[0]), -(-k // s.shape[1])
        return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    s = g["weight_scale"].float()
    return w * (s.reshape(-1, 1) if s.numel() == n else s.reshape(()))
