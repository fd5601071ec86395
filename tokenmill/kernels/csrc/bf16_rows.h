// Masked loads and stores of 16 bf16 values as fp32 lanes, for kernels that walk bf16 rows (AVX-512 BF16 only;
// include inside an __AVX512BF16__ guard).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

using bf16 = uint16_t;

inline __m512 load16(const bf16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
inline void store16(bf16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
// The lanes of columns j..j+15 that lie before d.
inline __mmask16 mask_at(int64_t j, int64_t d) {
  return d - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (d - j)) - 1);
}

}  // namespace
