// The view of a packed quantized weight (quant_layout.h describes the layout) that every quantized kernel reads:
// no torch and no intrinsics, so the AVX-512 kernels, the portable ones and the standalone NEON harness share it.
#pragma once

#include <cstdint>

namespace tokenmill_quant {

constexpr int64_t kBlockN = 16;   // outputs per block of the packed layouts

struct QuantView {
  const uint8_t* q;
  const uint16_t* scale;
  const uint16_t* min;   // 4 bits only
  int64_t bits, group, k, n;

  int64_t block_bytes() const { return k * kBlockN * bits / 8; }
  int64_t groups() const { return k / group; }
};

}  // namespace tokenmill_quant
