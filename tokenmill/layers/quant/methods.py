"""Quantization methods: each turns a linear layer's loaded weight into the kernel its forward calls.

The model file never branches on the method: the loader attaches one to every `Linear` (and picks the lm
head's), and `Linear.process_weights_after_loading` asks it for a kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.config import PREQUANTIZED_METHODS, check_quantization
from tokenmill.layers.packed_weight import PackedWeight, onednn_packing_helps
from tokenmill.layers.quant.kernel import QuantLinearKernel
from tokenmill.layers.quant.tensor import QuantizedWeight, quantize_int4, quantize_int8
from tokenmill.utils import init_logger

logger = init_logger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]


class PlainLinear:
    """F.linear on the weight as loaded: fp32 (transformers' exact operations) or where nothing is faster."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class UnquantizedMethod:
    """The weight as loaded, in the model dtype (oneDNN-packed, and in the AMX tile layout, where that helps)."""

    name = "none"

    def make_kernel(self, layer_name: str, weight: torch.Tensor, bias: torch.Tensor | None,
                    quantized: QuantizedWeight | None) -> Kernel:
        if quantized is not None:  # a GGUF block tensor loaded without --quantization gguf: never here
            raise ValueError(f"{layer_name}: a quantized tensor reached an unquantized layer")
        if onednn_packing_helps(weight):
            return PackedWeight(weight, bias)
        return PlainLinear(weight, bias)

    def lm_head(self) -> UnquantizedMethod:
        return self


class Int8Method(UnquantizedMethod):
    """Weight-only int8, one symmetric scale per output channel, quantized at load."""

    name = "int8"

    def make_kernel(self, layer_name, weight, bias, quantized):
        qw = quantized if quantized is not None else quantize_int8(weight)
        return QuantLinearKernel(qw, bias, weight.dtype, weight.device)

    def lm_head(self) -> Int8Method:
        return self


class Int4Method(UnquantizedMethod):
    """Weight-only int4 in groups with a scale and a minimum each, quantized at load. Its lm head is int8: the
    vocabulary projection is the layer most sensitive to rounding, and int8 still halves its bytes."""

    name = "int4"

    def __init__(self, group_size: int):
        self.group_size = group_size   # one of GROUP_SIZES: config.check_quantization, via get_quant_method

    def make_kernel(self, layer_name, weight, bias, quantized):
        k = weight.shape[1]
        if k % self.group_size:
            raise ValueError(f"--quantization-group-size {self.group_size} does not divide the input size {k} of "
                             f"{layer_name}; use a group size that divides every layer's input (32, 64 or 128)")
        qw = quantized if quantized is not None else quantize_int4(weight, self.group_size)
        return QuantLinearKernel(qw, bias, weight.dtype, weight.device)

    def lm_head(self) -> Int8Method:
        return Int8Method()


class GGUFMethod(UnquantizedMethod):
    """GGUF's Q8_0, Q4_0 and Q4_1 blocks run as they are in the file (value for value); tensors the file holds
    as floats stay unquantized."""

    name = "gguf"

    def make_kernel(self, layer_name, weight, bias, quantized):
        if quantized is None:
            return super().make_kernel(layer_name, weight, bias, None)
        return QuantLinearKernel(quantized, bias, weight.dtype, weight.device)

    def lm_head(self) -> GGUFMethod:
        return self


class W8A8Method(Int8Method):
    """int8 weights per output channel and per-token int8 activations on steps of many rows (layers/quant/w8a8.py);
    `prepare` folds the calibrated SmoothQuant factors into the float weights first. The lm head and down_proj
    are weight-only int8 (W8A8_WEIGHT_ONLY)."""

    name = "w8a8"

    def __init__(self, model_path: str | None = None):
        self.model_path = model_path

    def make_kernel(self, layer_name, weight, bias, quantized):
        from tokenmill.layers.quant.w8a8 import W8A8_WEIGHT_ONLY, W8A8Kernel

        qw = quantized if quantized is not None and quantized.bits == 8 else quantize_int8(
            quantized.dequantize() if quantized is not None else weight)
        if layer_name.endswith(W8A8_WEIGHT_ONLY):
            return QuantLinearKernel(qw, bias, weight.dtype, weight.device)
        return W8A8Kernel(qw, bias, weight.dtype, weight.device)

    def prepare(self, model) -> None:
        from tokenmill.layers.quant.w8a8 import apply_smoothing, load_activation_maxima, smoothing_path

        maxima = load_activation_maxima(self.model_path) if self.model_path else None
        if maxima is None:
            logger.warning("w8a8 without SmoothQuant factors (run `tokenmill quantize %s` once): activations are "
                           "quantized as they are, which costs accuracy", self.model_path)
            return
        logger.info("w8a8: SmoothQuant factors for %d layers from %s", apply_smoothing(model, maxima),
                    smoothing_path(self.model_path))

    def lm_head(self) -> Int8Method:
        return Int8Method()


class PrequantizedMethod(GGUFMethod):
    """A checkpoint quantized by another tool (GPTQ, AWQ, compressed-tensors; model/prequantized.py turns its
    tensors into QuantizedWeights): those run on the int8 / int4 kernels value for value; the layers it keeps in
    floats (the lm head, as a rule) stay unquantized."""

    def __init__(self, name: str):
        self.name = name


def get_quant_method(name: str | None, group_size: int = 32, model_format: str = "hf",
                     model_path: str | None = None) -> UnquantizedMethod:
    """The method for `--quantization`; unknown names and formats it cannot read fail here, naming the flag."""
    check_quantization(name, group_size, model_format)
    if name == "int8":
        return Int8Method()
    if name == "int4":
        return Int4Method(group_size)
    if name == "gguf":
        return GGUFMethod()
    if name == "w8a8":
        return W8A8Method(model_path)
    if name in PREQUANTIZED_METHODS:
        return PrequantizedMethod(name)
    return UnquantizedMethod()
