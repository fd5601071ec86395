// Pieces of the decode kernel that work on one 16-token block of the paged cache: loading stored values as
// fp32, the scores of a block for the query heads of one KV head (AVX-512 BF16 and AMX), the horizontal-sum tree
// they share, and fp8 -> bf16 conversion. Included by paged_attention.cpp only.
#pragma once

#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <bit>
#include <cstdint>
#include <cstring>

#include "amx.h"

namespace tokenmill_decode {

// The hot case spelled out: head_dim 64 held in four 16-lane registers. Each key is loaded and converted
// once and scored against every query row that sees it; each value row is loaded once for all rows.
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const double*) { return _mm512_setzero_ps(); }  // never used: d64 is bf16/fp32 only
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// fp8 e5m2 is the top byte of an fp16; e4m3 becomes an fp16 with its exponent 8 lower (sign, then the 7 bits
// shifted into place), so times 2^8 it is exact, subnormals included (writes saturate: no NaN is stored).
inline __m512 load16(const at::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline __m512 load16(const at::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
}

// The decode kernels' horizontal sums, 16 at once (score_decode_block says why).
// Four rows' vectors -> one vector whose 128-bit chunk c holds chunk c's partial sums of rows 0..3, in order.
inline __m512 sum_rows4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));  // [0 1 0 1] per chunk
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));  // [2 3 2 3]
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
}
// Two vectors of 4-row chunks (rows 0..3 | 4..7 of each) -> their chunks summed pairwise: [a0+a1, a2+a3, b0+b1, b2+b3].
inline __m512 sum_chunks(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

#if defined(__AVX512BF16__)
// Decode scores of one 16-key block for the R query heads of a KV head, returned in registers (lane i = key i).
// Each key row is two plain loads; each head's products with a row stay a 16-lane vector of partial sums, and
// 16 rows' vectors are summed into one vector of 16 scores by a tree of shuffles (45 simple instructions a head
// a block). Gathering a column of 16 keys per pair instead (32 gathers a block) was ~55% of decode attention on
// AMD Zen 4, whose gathers are slow: this form measured 0.77 -> 0.65 ms (batch 1, 256 tokens, 30 layers) and
// 151 -> 113 ms (128 sequences of 320 tokens).
template <int R>
inline void score_decode_block(const at::BFloat16* kb, const at::BFloat16* q, __m512* scores, int64_t kv_head,
                               int64_t kv_token_stride, float scale) {
  __m512bh q0[R], q1[R];
  for (int r = 0; r < R; ++r) {
    q0[r] = (__m512bh)_mm512_loadu_si512(q + (kv_head * R + r) * 64);
    q1[r] = (__m512bh)_mm512_loadu_si512(q + (kv_head * R + r) * 64 + 32);
  }
  __m512 quad[4][R];  // rows 4g..4g+3, chunk c's partial sums
  for (int g = 0; g < 4; ++g) {
    __m512bh k0[4], k1[4];
    for (int j = 0; j < 4; ++j) {
      const at::BFloat16* kr = kb + (4 * g + j) * kv_token_stride;
      k0[j] = (__m512bh)_mm512_loadu_si512(kr);
      k1[j] = (__m512bh)_mm512_loadu_si512(kr + 32);
    }
    for (int r = 0; r < R; ++r) {
      __m512 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), k0[j], q0[r]), k1[j], q1[r]);
      quad[g][r] = sum_rows4(v[0], v[1], v[2], v[3]);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    scores[r] = _mm512_mul_ps(sum_chunks(sum_chunks(quad[0][r], quad[1][r]), sum_chunks(quad[2][r], quad[3][r])), vscale);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENMILL_DECODE_AMX 1
// The same scores on AMX tiles, with no shuffles: the block's 16 key rows load straight from the cache as an A
// tile (their row stride is the cache's token stride), times Q^T of the R query heads as B tiles (tiles 0
// and 1, loaded once per task by load_q_tiles), gives [16 keys x 16 heads] in fp32; each head's column is then
// read back from L1.
template <int R>
inline void load_q_tiles(const at::BFloat16* q, int64_t kv_head, uint32_t* qt) {
  std::memset(qt, 0, 2 * 256 * sizeof(uint32_t));
  for (int r = 0; r < R; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + (kv_head * R + r) * 64);
    for (int p = 0; p < 32; ++p) qt[(p / 16) * 256 + (p % 16) * 16 + r] = pairs[p];  // row = d pair, col = head
  }
  TILE_LOAD(0, qt, 64);
  TILE_LOAD(1, qt + 256, 64);
}

template <int R>
inline void score_decode_block_amx(const at::BFloat16* kb, __m512* scores, int64_t kv_token_stride, float scale,
                                   float* c) {
  _tile_zero(4);
  TILE_LOAD(2, kb, kv_token_stride * 2);
  TILE_LOAD(3, kb + 32, kv_token_stride * 2);
  _tile_dpbf16ps(4, 2, 0);
  _tile_dpbf16ps(4, 3, 1);
  _tile_stored(4, c, 64);
  __asm__ volatile("" ::: "memory");
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    scores[r] = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(r)), c, 4), vscale);
}
#endif


#if defined(__AVX512BF16__)
// fp8 -> bf16, 32 values at once, by looking the 7 magnitude bits up in a 128-entry table (four registers, two
// permutes and a blend) and putting the sign back. Exact: every e4m3 and e5m2 value, subnormals included, is a
// normal bf16. It lets a bf16 model's decode attention over an fp8 cache run the bf16 kernels' dpbf16 math: the
// fp32 conversions it replaces made the fp8 cache slower to attend than the bf16 cache it halves.
template <typename KT>
struct Fp8ToBf16 {
  __m512i t[4];
  Fp8ToBf16() {
    alignas(64) uint16_t v[128];
    for (int i = 0; i < 128; ++i) {
      const uint8_t bits = static_cast<uint8_t>(i);
      KT x;
      std::memcpy(&x, &bits, 1);
      v[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(x)) >> 16);
    }
    for (int k = 0; k < 4; ++k) t[k] = _mm512_load_si512(v + 32 * k);
  }
  void operator()(const KT* p, at::BFloat16* dst) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_permutex2var_epi16(t[0], b, t[1]), hi = _mm512_permutex2var_epi16(t[2], b, t[3]);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    _mm512_storeu_si512(dst, _mm512_or_si512(mag, sign));
  }
  // n rows of 64 values, `stride` elements apart, into dst as contiguous rows (an attention block's K or V)
  void rows(const KT* src, int64_t stride, int64_t n, at::BFloat16* dst) const {
    for (int64_t j = 0; j < n; ++j) {
      (*this)(src + j * stride, dst + j * 64);
      (*this)(src + j * stride + 32, dst + j * 64 + 32);
    }
  }
};
#endif

}  // namespace tokenmill_decode
#endif
