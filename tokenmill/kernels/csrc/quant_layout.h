// The packed layout of quantized weights that quant_gemm.cpp (VNNI) and quant_tiles.cpp (AMX, vectors) read. Include
// inside an AVX-512 F/BW guard.
//
// One layout serves int8 (per channel), int4 (groups with a scale and a minimum) and GGUF's Q8_0 / Q4_0 / Q4_1
// blocks (repacked once at load, value for value). It is the layout of AVX-512 VNNI's `vpdpbusd` (unsigned
// bytes x signed bytes, 4 products summed per 32-bit lane): per block of 16 outputs, 64-byte units of
// 16 outputs x 4 consecutive k, so one instruction advances 16 outputs by 4 inputs with no horizontal sums.
//   8 bits: q [N/16, K/4, 16, 4] as unsigned bytes q + 128, w = scale * q
//   4 bits: q [N/16, K/8, 16, 4] bytes, k 8u..8u+3 in the low nibbles and 8u+4..8u+7 in the high ones,
//           w = scale * q + min
//   scale, min: [N/16, K/G, 16] fp16, one per group of G inputs of each output (G = K for per-channel int8).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#include "quant_args.h"

namespace tokenmill_quant {

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}


inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline __m512i high_nibbles(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
// The 8 values of each of 16 outputs at k kk..kk+7 of block b (kk a multiple of 8), dequantized in fp32:
// v[e] holds k = kk + e, one lane per output. w = s * stored + mn per group: the caller passes the group's scale
// and minimum (8 bits: stored = q + 128 and mn = -128 s).
inline void dequantize8(const QuantView& w, int64_t b, int64_t kk, __m512 s, __m512 mn, __m512 v[8]) {
  __m512i units[2];  // [16 outputs x 4 k] bytes each, as unsigned values: k kk..kk+3 and kk+4..kk+7
  if (w.bits == 8) {
    const uint8_t* p = w.q + b * w.block_bytes() + (kk / 4) * 64;
    units[0] = _mm512_loadu_si512(p);
    units[1] = _mm512_loadu_si512(p + 64);
  } else {
    const __m512i packed = _mm512_loadu_si512(w.q + b * w.block_bytes() + (kk / 8) * 64);
    units[0] = low_nibbles(packed);
    units[1] = high_nibbles(packed);
  }
  for (int u = 0; u < 2; ++u)
    for (int e = 0; e < 4; ++e) {
      const __m512i qi = _mm512_and_si512(_mm512_srli_epi32(units[u], 8 * e), _mm512_set1_epi32(0xFF));
      v[4 * u + e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), s, mn);
    }
}

}  // namespace tokenmill_quant
