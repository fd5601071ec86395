"""Weight quantization behind the linear layers' `quant_method` seam (int8, int4, GGUF blocks)."""

from tokenmill.config import GROUP_SIZES, QUANTIZATION_METHODS
from tokenmill.layers.quant.methods import (
    GGUFMethod,
    Int4Method,
    Int8Method,
    UnquantizedMethod,
    get_quant_method,
)
from tokenmill.layers.quant.tensor import QuantizedWeight, concat_rows, quantize_int4, quantize_int8

__all__ = ["GROUP_SIZES", "QUANTIZATION_METHODS", "GGUFMethod", "Int4Method", "Int8Method", "QuantizedWeight",
           "UnquantizedMethod", "concat_rows", "get_quant_method", "quantize_int4", "quantize_int8"]
