// A quantized op's weight arguments checked and viewed (QuantView): shared by the AVX-512 and portable builds.
#pragma once

#include <ATen/ATen.h>

#include "quant_view.h"

namespace tokenmill_quant {

inline QuantView view_of(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                         int64_t bits, int64_t group, int64_t n, int64_t k) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantized gemm: bits must be 8 or 4");
  TORCH_CHECK(n % kBlockN == 0 && group % 32 == 0 && k % group == 0, "quantized gemm: N % 16, G % 32, K % G");
  TORCH_CHECK(q.is_contiguous() && q.numel() * 8 == n * k * bits, "quantized gemm: packed q mismatch");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == n * (k / group),
              "quantized gemm: scale must be fp16 [N/16, K/G, 16]");
  const uint16_t* mp = nullptr;
  if (bits == 4) {
    TORCH_CHECK(min.has_value() && min->defined() && min->scalar_type() == at::kHalf && min->is_contiguous() &&
                min->numel() == scale.numel(), "quantized gemm: 4 bits need an fp16 min like the scale");
    mp = reinterpret_cast<const uint16_t*>(min->data_ptr());
  }
  return {reinterpret_cast<const uint8_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(scale.data_ptr()), mp,
          bits, group, k, n};
}

}  // namespace tokenmill_quant
