// Eight fp32 lanes and sixteen int32 lanes for the portable kernels (portable_kernels.h): AVX2 (+FMA, F16C)
// registers on x86, NEON (+dotprod where the compiler has it) on ARM. The kernels are written once against
// these few operations; each operation is one or two instructions of either set. No torch here: the NEON build
// is cross-compiled into a standalone harness and run under qemu (tests/native/).
//
// Rounding follows the AVX-512 kernels where they define the bits: fused multiply-adds, bf16 stores rounded to
// nearest even, int conversions rounding half to even, so the integer and bf16 matmuls give the AVX-512 kernels'
// bits exactly (tests/test_portable_kernels.py compares them).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_SIMD8_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define TM_SIMD8_NEON 1
#include <arm_neon.h>
#endif

#if defined(TM_SIMD8_AVX2) || defined(TM_SIMD8_NEON)
#define TM_SIMD8 1

namespace tm_simd {

using bf16 = uint16_t;

#if defined(TM_SIMD8_AVX2)

struct F8 { __m256 v; };

inline F8 zero() { return {_mm256_setzero_ps()}; }
inline F8 set1(float x) { return {_mm256_set1_ps(x)}; }
inline F8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
inline F8 add(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F8 sub(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F8 mul(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 div(F8 a, F8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F8 max(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F8 min(F8 a, F8 b) { return {_mm256_min_ps(a.v, b.v)}; }
inline F8 fma(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }    // a b + c, one rounding
inline F8 fnma(F8 a, F8 b, F8 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b, one rounding
inline F8 floor(F8 a) { return {_mm256_floor_ps(a.v)}; }
// 2^n for integral n in the normal range
inline F8 exp2_int(F8 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
inline F8 load_bf16(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline void store_bf16(bf16* p, F8 a) {  // round to nearest even
  __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline F8 load_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
// 16 bf16 holding 8 (k, k+1) pairs, one per output: the first and the second of each pair as fp32 lanes
inline void load_bf16_pairs(const bf16* p, F8& first, F8& second) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  first.v = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  second.v = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Sixteen int32 lanes (one per output of a 16-output block) and the byte dot products of the quantized layout:
// lane o += the 4 products of output o's 4 bytes with the 4 broadcast activation bytes (vpdpbusd's sums).
struct I16 { __m256i lo, hi; };

inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// 8-bit weights, stored as q + 128: signed q against signed x, as maddubs(|q|, sign(x, q)): every pair of
// products is at most 2 x 128 x 127, inside int16 (maddubs of the unsigned byte would saturate).
inline __m256i dot_s8(__m256i acc, __m256i stored, __m256i x) {
  const __m256i q = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline __m256i dot_u4(__m256i acc, __m256i u, __m256i x) {  // u in 0..15
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
// One 64-byte unit (16 outputs x 4 k) of 8-bit weights against 4 activation bytes
inline void dot8(I16& acc, const uint8_t* unit, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  acc.lo = dot_s8(acc.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)), x);
  acc.hi = dot_s8(acc.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32)), x);
}
// One 64-byte unit of 4-bit weights (low nibbles: k..k+3, high: k+4..k+7) against 8 activation bytes
inline void dot4(I16& acc, const uint8_t* unit, int32_t x_low, int32_t x_high) {
  const __m256i m = _mm256_set1_epi8(0x0F), xl = _mm256_set1_epi32(x_low), xh = _mm256_set1_epi32(x_high);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32));
  acc.lo = dot_u4(dot_u4(acc.lo, _mm256_and_si256(a, m), xl), _mm256_and_si256(_mm256_srli_epi16(a, 4), m), xh);
  acc.hi = dot_u4(dot_u4(acc.hi, _mm256_and_si256(b, m), xl), _mm256_and_si256(_mm256_srli_epi16(b, 4), m), xh);
}
// A 32-input block of 4-bit weights (4 units) against the block's hi and lo activation bytes (8 ints each):
// ih, il += the exact sums. The unsigned nibbles times signed bytes stay within int16 for all 8 products of a
// lane (8 x 2 x 15 x 127 = 30,480), so they are summed there and widened once: a third fewer instructions than
// widening each pair, and each unit's nibbles serve both parts.
inline void dot4_block(I16& ih, I16& il, const uint8_t* units, const int32_t* xh, const int32_t* xl) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  __m256i h0 = _mm256_setzero_si256(), h1 = h0, l0 = h0, l1 = h0;
  for (int u = 0; u < 4; ++u) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + 64 * u));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + 64 * u + 32));
    const __m256i al = _mm256_and_si256(a, m), ah = _mm256_and_si256(_mm256_srli_epi16(a, 4), m);
    const __m256i bl = _mm256_and_si256(b, m), bh = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    const __m256i xh0 = _mm256_set1_epi32(xh[2 * u]), xh1 = _mm256_set1_epi32(xh[2 * u + 1]);
    const __m256i xl0 = _mm256_set1_epi32(xl[2 * u]), xl1 = _mm256_set1_epi32(xl[2 * u + 1]);
    h0 = _mm256_add_epi16(h0, _mm256_add_epi16(_mm256_maddubs_epi16(al, xh0), _mm256_maddubs_epi16(ah, xh1)));
    h1 = _mm256_add_epi16(h1, _mm256_add_epi16(_mm256_maddubs_epi16(bl, xh0), _mm256_maddubs_epi16(bh, xh1)));
    l0 = _mm256_add_epi16(l0, _mm256_add_epi16(_mm256_maddubs_epi16(al, xl0), _mm256_maddubs_epi16(ah, xl1)));
    l1 = _mm256_add_epi16(l1, _mm256_add_epi16(_mm256_maddubs_epi16(bl, xl0), _mm256_maddubs_epi16(bh, xl1)));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  ih.lo = _mm256_add_epi32(ih.lo, _mm256_madd_epi16(h0, ones));
  ih.hi = _mm256_add_epi32(ih.hi, _mm256_madd_epi16(h1, ones));
  il.lo = _mm256_add_epi32(il.lo, _mm256_madd_epi16(l0, ones));
  il.hi = _mm256_add_epi32(il.hi, _mm256_madd_epi16(l1, ones));
}
// 256 a + b + c, as fp32 lanes: outputs 0..7 and 8..15
inline void combine(const I16& a, const I16& b, int32_t c, F8& lo, F8& hi) {
  const __m256i cv = _mm256_set1_epi32(c);
  lo.v = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(a.lo, 8), b.lo), cv));
  hi.v = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(a.hi, 8), b.hi), cv));
}
inline int32_t round_to_int(float x) { return _mm_cvtss_si32(_mm_set_ss(x)); }  // half to even

// Eight int32 lanes, for quantizing activations: rounded half to even from fp32, back to fp32, and stored
// as eight int8 (the values already within int8's range).
struct I8 { __m256i v; };
inline I8 round_int(F8 a) { return {_mm256_cvtps_epi32(a.v)}; }
inline F8 to_float(I8 a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline I8 iclamp(I8 a, int32_t lo, int32_t hi) {
  return {_mm256_max_epi32(_mm256_min_epi32(a.v, _mm256_set1_epi32(hi)), _mm256_set1_epi32(lo))};
}
inline I8 iadd(I8 a, I8 b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline I8 ishl8(I8 a) { return {_mm256_slli_epi32(a.v, 8)}; }
inline int32_t ihsum(I8 a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline void store_int8(int8_t* p, I8 a) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline F8 abs(F8 a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline float hmax(F8 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

#else  // NEON

struct F8 { float32x4_t a, b; };

inline F8 zero() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
inline F8 set1(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
inline F8 load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store(float* p, F8 x) { vst1q_f32(p, x.a); vst1q_f32(p + 4, x.b); }
inline F8 add(F8 x, F8 y) { return {vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)}; }
inline F8 sub(F8 x, F8 y) { return {vsubq_f32(x.a, y.a), vsubq_f32(x.b, y.b)}; }
inline F8 mul(F8 x, F8 y) { return {vmulq_f32(x.a, y.a), vmulq_f32(x.b, y.b)}; }
inline F8 div(F8 x, F8 y) { return {vdivq_f32(x.a, y.a), vdivq_f32(x.b, y.b)}; }
inline F8 max(F8 x, F8 y) { return {vmaxq_f32(x.a, y.a), vmaxq_f32(x.b, y.b)}; }
inline F8 min(F8 x, F8 y) { return {vminq_f32(x.a, y.a), vminq_f32(x.b, y.b)}; }
inline F8 fma(F8 x, F8 y, F8 c) { return {vfmaq_f32(c.a, x.a, y.a), vfmaq_f32(c.b, x.b, y.b)}; }
inline F8 fnma(F8 x, F8 y, F8 c) { return {vfmsq_f32(c.a, x.a, y.a), vfmsq_f32(c.b, x.b, y.b)}; }
inline F8 floor(F8 x) { return {vrndmq_f32(x.a), vrndmq_f32(x.b)}; }
inline float32x4_t exp2_int4(float32x4_t n) {
  const int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
  return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
inline F8 exp2_int(F8 n) { return {exp2_int4(n.a), exp2_int4(n.b)}; }
inline float32x4_t widen_bf16(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
inline F8 load_bf16(const bf16* p) {
  const uint16x8_t raw = vld1q_u16(p);
  return {widen_bf16(vget_low_u16(raw)), widen_bf16(vget_high_u16(raw))};
}
inline uint16x4_t narrow_bf16(float32x4_t x) {  // round to nearest even
  uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  u = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
  return vshrn_n_u32(u, 16);
}
inline void store_bf16(bf16* p, F8 x) { vst1q_u16(p, vcombine_u16(narrow_bf16(x.a), narrow_bf16(x.b))); }
inline F8 load_half(const uint16_t* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline void load_bf16_pairs(const bf16* p, F8& first, F8& second) {
  const uint32x4_t r0 = vld1q_u32(reinterpret_cast<const uint32_t*>(p));
  const uint32x4_t r1 = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4);
  const uint32x4_t mask = vdupq_n_u32(0xFFFF0000u);
  first = {vreinterpretq_f32_u32(vshlq_n_u32(r0, 16)), vreinterpretq_f32_u32(vshlq_n_u32(r1, 16))};
  second = {vreinterpretq_f32_u32(vandq_u32(r0, mask)), vreinterpretq_f32_u32(vandq_u32(r1, mask))};
}

struct I16 { int32x4_t v[4]; };

inline I16 izero() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
// lane o += 4 signed byte products of output o with the 4 bytes of x (sdot where the CPU has dotprod)
inline int32x4_t dot4x4(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
  const int16x8_t hi = vmull_high_s8(w, x);
  return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
inline void dot8(I16& acc, const uint8_t* unit, int32_t x4) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
  const uint8x16_t bias = vdupq_n_u8(0x80);
  for (int i = 0; i < 4; ++i)
    acc.v[i] = dot4x4(acc.v[i], vreinterpretq_s8_u8(veorq_u8(vld1q_u8(unit + 16 * i), bias)), x);
}
inline void dot4(I16& acc, const uint8_t* unit, int32_t x_low, int32_t x_high) {
  const int8x16_t xl = vreinterpretq_s8_s32(vdupq_n_s32(x_low)), xh = vreinterpretq_s8_s32(vdupq_n_s32(x_high));
  const uint8x16_t m = vdupq_n_u8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v = vld1q_u8(unit + 16 * i);
    acc.v[i] = dot4x4(acc.v[i], vreinterpretq_s8_u8(vandq_u8(v, m)), xl);
    acc.v[i] = dot4x4(acc.v[i], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xh);
  }
}
inline void dot4_block(I16& ih, I16& il, const uint8_t* units, const int32_t* xh, const int32_t* xl) {
  for (int u = 0; u < 4; ++u) {
    dot4(ih, units + 64 * u, xh[2 * u], xh[2 * u + 1]);
    dot4(il, units + 64 * u, xl[2 * u], xl[2 * u + 1]);
  }
}
inline void combine(const I16& a, const I16& b, int32_t c, F8& lo, F8& hi) {
  const int32x4_t cv = vdupq_n_s32(c);
  float32x4_t f[4];
  for (int i = 0; i < 4; ++i) f[i] = vcvtq_f32_s32(vaddq_s32(vaddq_s32(vshlq_n_s32(a.v[i], 8), b.v[i]), cv));
  lo = {f[0], f[1]};
  hi = {f[2], f[3]};
}
inline int32_t round_to_int(float x) { return vcvtns_s32_f32(x); }  // half to even

struct I8 { int32x4_t a, b; };
inline I8 round_int(F8 x) { return {vcvtnq_s32_f32(x.a), vcvtnq_s32_f32(x.b)}; }
inline F8 to_float(I8 x) { return {vcvtq_f32_s32(x.a), vcvtq_f32_s32(x.b)}; }
inline I8 iclamp(I8 x, int32_t lo, int32_t hi) {
  const int32x4_t l = vdupq_n_s32(lo), h = vdupq_n_s32(hi);
  return {vmaxq_s32(vminq_s32(x.a, h), l), vmaxq_s32(vminq_s32(x.b, h), l)};
}
inline I8 iadd(I8 x, I8 y) { return {vaddq_s32(x.a, y.a), vaddq_s32(x.b, y.b)}; }
inline I8 ishl8(I8 x) { return {vshlq_n_s32(x.a, 8), vshlq_n_s32(x.b, 8)}; }
inline int32_t ihsum(I8 x) { return vaddvq_s32(vaddq_s32(x.a, x.b)); }
inline void store_int8(int8_t* p, I8 x) {
  const int16x8_t w = vcombine_s16(vqmovn_s32(x.a), vqmovn_s32(x.b));
  vst1_s8(p, vqmovn_s16(w));
}
inline F8 abs(F8 x) { return {vabsq_f32(x.a), vabsq_f32(x.b)}; }
inline float hmax(F8 x) { return vmaxvq_f32(vmaxq_f32(x.a, x.b)); }

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

#endif

}  // namespace tm_simd

#endif  // TM_SIMD8
