// Paged attention for CPU: walks each request's block table directly, so every K/V byte is read once,
// with an online softmax in fp32 and the query heads that share a KV head processed together.
//
// One task per (request, kv head); OpenMP spreads the tasks over the cores. Query row t of request i sits
// at position seq_len - q_len + t and sees keys 0..that position (causal within the new tokens).
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V, in the model dtype or
// quantized (fp8 e4m3, fp8 e5m2, int8) with one scale per tensor: k_scale is folded into the query scale and
// v_scale into the output, so the loops only convert the stored values.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "amx.h"
#include "decode_blocks.h"
#include "vec_math.h"
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e5m2 x) { return static_cast<float>(x); }
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, double* out) { *out = x; }
inline void from_float(float x, at::BFloat16* out) { *out = at::BFloat16(x); }

// Load D values as fp32 (the compiler vectorises the bf16 -> fp32 shift).
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t d) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) dst[j] = to_float(src[j]);
}

// exp(x) as 2^n * 2^f with a degree-6 polynomial for 2^f: ~1e-7 relative error, and it vectorises.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t e = (static_cast<int32_t>(fi) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// Per-thread scratch, grown once and reused by every task (no allocation per task).
struct Scratch {
  std::vector<float> q, acc, m, l, k, v, s;
  void fit(int64_t rows, int64_t d, int64_t block_size) {
    if (static_cast<int64_t>(q.size()) < rows * d) { q.resize(rows * d); acc.resize(rows * d); }
    if (static_cast<int64_t>(m.size()) < rows) { m.resize(rows); l.resize(rows); }
    if (static_cast<int64_t>(k.size()) < block_size * d) { k.resize(block_size * d); v.resize(block_size * d); }
    if (static_cast<int64_t>(s.size()) < rows * block_size) s.resize(rows * block_size);
  }
};

// The query rows of one (request, kv head) as fp32, pre-scaled; row r = t * group + g.
template <typename T>
void load_queries(const T* q, float* qf, int64_t q_len, int64_t group, int64_t d, int64_t kv_head,
                  int64_t q_token_stride, int64_t q_head_stride, float scale) {
  for (int64_t t = 0; t < q_len; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + t * q_token_stride + (kv_head * group + g) * q_head_stride;
      float* dst = qf + (t * group + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = to_float(src[x]) * scale;
    }
}

inline void reset_state(float* acc, float* m, float* l, int64_t rows, int64_t d) {
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
}

// out = acc / l for every row, back in the model dtype.
template <typename T>
void store_rows(T* out, const float* acc, const float* l, int64_t q_len, int64_t group, int64_t d, int64_t kv_head,
                int64_t q_token_stride, int64_t q_head_stride, float v_scale) {
  for (int64_t t = 0; t < q_len; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = v_scale / l[r];
      T* dst = out + t * q_token_stride + (kv_head * group + g) * q_head_stride;
      for (int64_t x = 0; x < d; ++x) from_float(acc[r * d + x] * inv, dst + x);
    }
}

// One (request, kv head): rows = q_len * group query vectors sharing every K/V load. D is a compile-time
// constant for the common head sizes so the dot products and updates unroll into whole vector registers.
template <typename T, typename KT, int64_t D>
void attend_one(const T* q, T* out, const KT* k_cache, const KT* v_cache, const int32_t* table, int64_t q_len,
                int64_t seq_len, int64_t group, int64_t d_rt, int64_t block_size, int64_t kv_head,
                int64_t q_token_stride, int64_t q_head_stride, int64_t kv_token_stride, int64_t kv_block_stride,
                int64_t kv_head_stride, float scale, int64_t start_block, float* lse, float v_scale, int64_t window) {
  const int64_t d = D > 0 ? D : d_rt;
  thread_local Scratch sc;
  const int64_t rows = q_len * group;
  sc.fit(rows, d, block_size);
  float* __restrict qf = sc.q.data();
  float* __restrict acc = sc.acc.data();
  float* __restrict m = sc.m.data();
  float* __restrict l = sc.l.data();
  float* __restrict kf = sc.k.data();
  float* __restrict vf = sc.v.data();
  float* __restrict s = sc.s.data();  // s[r * block_size + j]: scores, then probabilities, of one block
  load_queries(q, qf, q_len, group, d, kv_head, q_token_stride, q_head_stride, scale);
  reset_state(acc, m, l, rows, d);
  const int64_t first_pos = seq_len - q_len;  // position of query token 0
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  // with a sliding window, query token t sees only keys first_pos + t - window + 1 .. first_pos + t
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t b = std::max(start_block, first_key / block_size); b < num_blocks; ++b) {
    const int64_t start = b * block_size;
    const int64_t n = std::min(block_size, seq_len - start);
    const int64_t base = static_cast<int64_t>(table[b]) * kv_block_stride + kv_head * kv_head_stride;
    for (int64_t j = 0; j < n; ++j) {
      load_row(k_cache + base + j * kv_token_stride, kf + j * d, d);
      load_row(v_cache + base + j * kv_token_stride, vf + j * d, d);
    }
    // the first query token that sees any key of this block; rows before it skip the block
    const int64_t t0 = std::max<int64_t>(0, start - first_pos);
    for (int64_t t = t0; t < q_len; ++t) {
      const int64_t visible = std::min(n, first_pos + t - start + 1);
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, first_pos + t - window + 1 - start) : 0;
      if (j0 >= visible) continue;  // the whole block lies behind this token's window
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = t * group + g;
        const float* qr = qf + r * d;
        float* sr = s + r * block_size;
        for (int64_t j = j0; j < visible; ++j) {
          const float* kr = kf + j * d;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
          sr[j] = dot;
        }
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < visible; ++j) block_max = std::max(block_max, sr[j]);
        const float new_max = std::max(m[r], block_max);
        const float correction = fast_exp(m[r] - new_max);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j0; j < visible; ++j) {
          sr[j] = fast_exp(sr[j] - new_max);
          sum += sr[j];
        }
        l[r] = l[r] * correction + sum;
        m[r] = new_max;
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) ar[x] *= correction;
        for (int64_t j = j0; j < visible; ++j) {
          const float p = sr[j];
          const float* vr = vf + j * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) ar[x] += p * vr[x];
        }
      }
    }
  }
  store_rows(out, acc, l, q_len, group, d, kv_head, q_token_stride, q_head_stride, v_scale);
  if (lse)
    for (int64_t t = 0; t < q_len; ++t)
      for (int64_t g = 0; g < group; ++g) lse[t * (q_token_stride / q_head_stride) + kv_head * group + g] = m[t * group + g] +
                                                                                            std::log(l[t * group + g]);
}

#if defined(__AVX512F__)
using namespace tokenmill_decode;  // decode_blocks.h: load16, score_decode_block, Fp8ToBf16

// The parts of a block's work that decode_d64 and decode_d64_heads share, inlined into each (as called
// functions the state left registers).
// Scores of a block's 16 key rows against R query rows held in fp32: each row's products stay a vector of partial
// sums, 16 rows summed at once by the shuffle tree (a horizontal sum per row and head was a third of this loop:
// fp8 cache, 30 layers of 128 x 320 tokens: 125 -> 116 ms). Rows past the sequence are read too (the block holds
// them) and masked by the caller.
template <int R, typename KT>
[[gnu::always_inline]] inline void score_rows_fp32(const KT* kb, int64_t stride, const float* qf, __m512* sv) {
  constexpr int64_t d = 64;
  __m512 quad[4][R];
  for (int g = 0; g < 4; ++g) {
    __m512 v[4][R];
    for (int j = 0; j < 4; ++j) {
      const KT* kr = kb + (4 * g + j) * stride;
      const __m512 k0 = load16(kr), k1 = load16(kr + 16), k2 = load16(kr + 32), k3 = load16(kr + 48);
      for (int r = 0; r < R; ++r) {
        const float* qr = qf + r * d;
        __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qr), k0);
        p = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16), k1, p);
        p = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 32), k2, p);
        v[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 48), k3, p);
      }
    }
    for (int r = 0; r < R; ++r) quad[g][r] = sum_rows4(v[0][r], v[1][r], v[2][r], v[3][r]);
  }
  for (int r = 0; r < R; ++r)
    sv[r] = sum_chunks(sum_chunks(quad[0][r], quad[1][r]), sum_chunks(quad[2][r], quad[3][r]));
}

// The block's softmax step for R query rows: the running maxima m, vector sums l and accumulators acc rescaled
// when a maximum moves (rare after the first blocks), the block's probabilities into s ([R][16]).
template <int R>
[[gnu::always_inline]] inline void softmax_block(const __m512* sv, __mmask16 valid, float* m, __m512* l,
                                                 __m512 (*acc)[4], float* s) {
  for (int r = 0; r < R; ++r) {
    const float block_max = _mm512_mask_reduce_max_ps(valid, sv[r]);
    if (block_max > m[r]) {
      const __m512 c = _mm512_set1_ps(fast_exp(m[r] - block_max));
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_mul_ps(acc[r][k], c);
      l[r] = _mm512_mul_ps(l[r], c);
      m[r] = block_max;
    }
    const __m512 pv = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv[r], _mm512_set1_ps(m[r]))));
    l[r] = _mm512_add_ps(l[r], pv);  // the row sum stays a vector; one reduction at the end
    _mm512_store_ps(s + r * 16, pv);
  }
}

// acc[r] += sum over the block's first n value rows of s[r][j] * v[j].
template <int R, typename VT>
[[gnu::always_inline]] inline void accumulate_rows(const VT* v, int64_t stride, int64_t n, const float* s,
                                                   __m512 (*acc)[4]) {
  for (int64_t j = 0; j < n; ++j) {
    const VT* vr = v + j * stride;
    const __m512 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(s[r * 16 + j]);
      acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
    }
  }
}

// Ask for one KV head's 16 rows of a block (K and V, at `offset` in each cache) ahead of their use: blocks are
// scattered and mostly not in cache, so the next one's loads start while this one is worked on.
template <typename KT>
[[gnu::always_inline]] inline void prefetch_head_rows(const KT* k_cache, const KT* v_cache, int64_t offset,
                                                      int64_t token_stride) {
  for (int64_t j = 0; j < 16; ++j) {
    const char* kp = reinterpret_cast<const char*>(k_cache + offset + j * token_stride);
    const char* vp = reinterpret_cast<const char*>(v_cache + offset + j * token_stride);
    for (int64_t line = 0; line < static_cast<int64_t>(64 * sizeof(KT)); line += 64) {
      _mm_prefetch(kp + line, _MM_HINT_T0);
      _mm_prefetch(vp + line, _MM_HINT_T0);
    }
  }
}

// A head's R output rows from its accumulators, vector sums and maxima (and each row's log-sum-exp where asked).
template <typename T, int R>
[[gnu::always_inline]] inline void write_head_rows(__m512 (*acc)[4], const __m512* l, const float* m, float v_scale,
                                                   T* out, float* lse, int64_t head) {
  constexpr int64_t d = 64;
  for (int r = 0; r < R; ++r) {
    alignas(64) float o[d];
    const float sum = _mm512_reduce_add_ps(l[r]);
    const __m512 inv = _mm512_set1_ps(v_scale / sum);
    for (int k = 0; k < 4; ++k) _mm512_store_ps(o + 16 * k, _mm512_mul_ps(acc[r][k], inv));
    T* dst = out + (head * R + r) * d;
    for (int64_t x = 0; x < d; ++x) from_float(o[x], dst + x);
    if (lse) lse[head * R + r] = m[r] + std::log(sum);
  }
}

// Decode (one new token) with R <= 4 query heads per KV head and 16-token blocks: the whole running state
// (R x 64 accumulators, maxima, sums) lives in registers, and each block's softmax is one vector of 16 keys.
// With `part` given, only blocks [start_block, end_block) are walked and the unnormalised state goes there
// ([R][64] accumulators, then R maxima, then R sums) for a later merge (flash-decoding).
template <typename T, typename KT, int R>
void decode_d64(const T* q, T* out, const KT* k_cache, const KT* v_cache, const int32_t* table, int64_t seq_len,
                int64_t kv_head, int64_t kv_token_stride, int64_t kv_block_stride, int64_t kv_head_stride, float scale,
                int64_t start_block, float* lse, float v_scale, int64_t window, int64_t end_block = -1,
                float* part = nullptr, bool amx = false) {
  constexpr int64_t d = 64, block = 16;
  alignas(64) float s[R * block];
#if defined(__AVX512BF16__)
  // a bf16 model over an fp8 cache: each block's rows become bf16 in L1 first (Fp8ToBf16 says why)
  constexpr bool kFp8Bf16 = std::is_same_v<T, at::BFloat16> &&
                            (std::is_same_v<KT, at::Float8_e4m3fn> || std::is_same_v<KT, at::Float8_e5m2>);
  static const Fp8ToBf16<std::conditional_t<kFp8Bf16, KT, at::Float8_e4m3fn>> fp8;
  alignas(64) at::BFloat16 kbuf[kFp8Bf16 ? block * d : 1], vbuf[kFp8Bf16 ? block * d : 1];
#endif
  alignas(64) float qf[R * d];
#if defined(TOKENMILL_DECODE_AMX)
  alignas(64) uint32_t qt[2 * 256];
  alignas(64) float c[256];
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, at::BFloat16>) {
    if (amx) load_q_tiles<R>(q, kv_head, qt);
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t x = 0; x < d; ++x) qf[r * d + x] = to_float(q[(kv_head * R + r) * d + x]) * scale;
  __m512 acc[R][4], l[R];
  float m[R];
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = _mm512_setzero_ps();
  }
  const int64_t num_blocks = end_block >= 0 ? std::min(end_block, (seq_len + block - 1) / block)
                                            : (seq_len + block - 1) / block;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;  // a sliding window's start
  for (int64_t b = std::max(start_block, first_key / block); b < num_blocks; ++b) {
    const int64_t n = std::min(block, seq_len - b * block);
    const int64_t head_offset = kv_head * kv_head_stride;
    const KT* kb = k_cache + static_cast<int64_t>(table[b]) * kv_block_stride + head_offset;
    const KT* vb = v_cache + static_cast<int64_t>(table[b]) * kv_block_stride + head_offset;
    if (b + 1 < num_blocks)
      prefetch_head_rows(k_cache, v_cache, static_cast<int64_t>(table[b + 1]) * kv_block_stride + head_offset,
                         kv_token_stride);
    __m512 sv[R];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, at::BFloat16>) {
#if defined(TOKENMILL_DECODE_AMX)
      if (amx)
        score_decode_block_amx<R>(kb, sv, kv_token_stride, scale, c);
      else
#endif
        score_decode_block<R>(kb, q, sv, kv_head, kv_token_stride, scale);
    } else if constexpr (kFp8Bf16) {
      fp8.rows(kb, kv_token_stride, block, kbuf);  // rows past n too (the block holds them): their lanes are masked
      score_decode_block<R>(kbuf, q, sv, kv_head, d, scale);
    } else
#endif
    score_rows_fp32<R>(kb, kv_token_stride, qf, sv);
    const int64_t skip = std::max<int64_t>(0, first_key - b * block);  // keys before the window, in its first block
    const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << skip) - 1u));
    softmax_block<R>(sv, valid, m, l, acc, s);
    const auto accumulate_v = [&](const auto* v, int64_t stride) { accumulate_rows<R>(v, stride, n, s, acc); };
#if defined(__AVX512BF16__)
    if constexpr (kFp8Bf16) {
      fp8.rows(vb, kv_token_stride, n, vbuf);
      accumulate_v(vbuf, d);
      continue;
    }
#endif
    accumulate_v(vb, kv_token_stride);
  }
  if (part) {
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(part + r * d + 16 * k, acc[r][k]);
      part[R * d + r] = m[r];
      part[R * d + R + r] = _mm512_reduce_add_ps(l[r]);
    }
    return;
  }
  write_head_rows<T, R>(acc, l, m, v_scale, out, lse, kv_head);
}

// decode_d64 for KV heads kv_head .. kv_head + H - 1 in one pass over the blocks, for heads_together (see
// paged_attention): each head's state lives in L1 between its turns and its arithmetic is decode_d64's
// (not AMX's), so a token gets the same bits either way. No parts (flash-decoding splits stay per head).
template <typename T, typename KT, int R, int H>
void decode_d64_heads(const T* q, T* out, const KT* k_cache, const KT* v_cache, const int32_t* table, int64_t seq_len,
                int64_t kv_head, int64_t kv_token_stride, int64_t kv_block_stride, int64_t kv_head_stride, float scale,
                int64_t start_block, float* lse, float v_scale, int64_t window, int64_t end_block = -1,
                float* part = nullptr, bool amx = false) {
  constexpr int64_t d = 64, block = 16;
  alignas(64) float s[R * block];
#if defined(__AVX512BF16__)
  // a bf16 model over an fp8 cache: each block's rows become bf16 in L1 first (Fp8ToBf16 says why)
  constexpr bool kFp8Bf16 = std::is_same_v<T, at::BFloat16> &&
                            (std::is_same_v<KT, at::Float8_e4m3fn> || std::is_same_v<KT, at::Float8_e5m2>);
  static const Fp8ToBf16<std::conditional_t<kFp8Bf16, KT, at::Float8_e4m3fn>> fp8;
  alignas(64) at::BFloat16 kbuf[kFp8Bf16 ? block * d : 1], vbuf[kFp8Bf16 ? block * d : 1];
#endif
  alignas(64) float qf[H][R * d];
  (void)amx; (void)end_block; (void)part;   // per head only: AMX scores, flash-decoding parts
  __m512 acc[H][R][4], l[H][R];
  float m[H][R];
  for (int hh = 0; hh < H; ++hh)
    for (int r = 0; r < R; ++r) {
      for (int64_t x = 0; x < d; ++x) qf[hh][r * d + x] = to_float(q[((kv_head + hh) * R + r) * d + x]) * scale;
      for (int k = 0; k < 4; ++k) acc[hh][r][k] = _mm512_setzero_ps();
      m[hh][r] = -std::numeric_limits<float>::infinity();
      l[hh][r] = _mm512_setzero_ps();
    }
  const int64_t num_blocks = (seq_len + block - 1) / block;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;  // a sliding window's start
  for (int64_t b = std::max(start_block, first_key / block); b < num_blocks; ++b) {
    const int64_t n = std::min(block, seq_len - b * block);
    for (int hh = 0; hh < H; ++hh) {
    const int64_t head = kv_head + hh;
    if (b + 1 < num_blocks)   // this head's rows of the next block, as decode_d64 asks for them
      prefetch_head_rows(k_cache, v_cache,
                         static_cast<int64_t>(table[b + 1]) * kv_block_stride + head * kv_head_stride, kv_token_stride);
    __m512 la[R][4], ll[R];   // this head's state in registers for the block (as arrays indexed by hh it stayed in memory)
    float lm[R];
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) la[r][k] = acc[hh][r][k];
      ll[r] = l[hh][r];
      lm[r] = m[hh][r];
    }
    const KT* kb = k_cache + static_cast<int64_t>(table[b]) * kv_block_stride + head * kv_head_stride;
    const KT* vb = v_cache + static_cast<int64_t>(table[b]) * kv_block_stride + head * kv_head_stride;
    __m512 sv[R];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, at::BFloat16>) {
      score_decode_block<R>(kb, q, sv, head, kv_token_stride, scale);
    } else if constexpr (kFp8Bf16) {
      fp8.rows(kb, kv_token_stride, block, kbuf);  // rows past n too (the block holds them): their lanes are masked
      score_decode_block<R>(kbuf, q, sv, head, d, scale);
    } else
#endif
    score_rows_fp32<R>(kb, kv_token_stride, qf[hh], sv);
    const int64_t skip = std::max<int64_t>(0, first_key - b * block);  // keys before the window, in its first block
    const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << skip) - 1u));
    softmax_block<R>(sv, valid, lm, ll, la, s);
    const auto accumulate_v = [&](const auto* v, int64_t stride) { accumulate_rows<R>(v, stride, n, s, la); };
#if defined(__AVX512BF16__)
    if constexpr (kFp8Bf16) {
      fp8.rows(vb, kv_token_stride, n, vbuf);
      accumulate_v(vbuf, d);
    } else
#endif
      accumulate_v(vb, kv_token_stride);
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) acc[hh][r][k] = la[r][k];
      l[hh][r] = ll[r];
      m[hh][r] = lm[r];
    }
    }
  }
  for (int hh = 0; hh < H; ++hh) write_head_rows<T, R>(acc[hh], l[hh], m[hh], v_scale, out, lse, kv_head + hh);
}

#endif

constexpr int64_t kDecodeLoopMaxQueryLen = 8;  // = KERNEL_MAX_QUERY_LEN of attention/cpu.py
// Flash-decoding: a decoded token that walks more than this many 16-token blocks is attended in parts of this
// many blocks, each a task of its own, then merged by their maxima and sums. Otherwise one request of a long
// context is three tasks (its KV heads) on two cores, read at a third of the memory's speed. The blocks walked
// are those past start_block (a cascade's shared prefix is attended elsewhere: counting it made empty parts,
// two of three tasks per token in W3's decode steps). The split depends only on the token's own sequence length
// and start_block, so a token gets the same bits whatever else is in the batch.
constexpr int64_t kSplitBlocks = 32;
constexpr int64_t kHeadsTogetherMax = 4;          // KV heads one task can take (their state stays in L1)
constexpr int64_t kHeadsTogetherMinTokens = 16;   // decoded tokens in the call, so both cores stay busy
constexpr int64_t kSplitTokens = kSplitBlocks * 16;

// Merge the parts of one query head: out = sum(acc_p * e^(m_p - M)) / sum(l_p * e^(m_p - M)) * v_scale.
template <typename T>
void merge_parts(const float* parts, int64_t num_parts, int64_t stride, int R, int r, float v_scale, T* out,
                 float* lse) {
  constexpr int64_t d = 64;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < num_parts; ++p) top = std::max(top, parts[p * stride + R * d + r]);
  float acc[d] = {};
  float sum = 0.0f;
  for (int64_t p = 0; p < num_parts; ++p) {
    const float* part = parts + p * stride;
    const float l = part[R * d + R + r];
    if (l == 0.0f) continue;  // a part with no key this token sees
    const float c = fast_exp(part[R * d + r] - top);
    sum += l * c;
    for (int64_t x = 0; x < d; ++x) acc[x] += part[r * d + x] * c;
  }
  const float inv = v_scale / sum;
  for (int64_t x = 0; x < d; ++x) from_float(acc[x] * inv, out + x);
  if (lse) *lse = top + std::log(sum);
}

// rows: the batch rows to compute (the others are left untouched in `out`). start_block > 0 skips each row's
// first blocks (a prefix attended elsewhere); lse, when given ([T, Hq] fp32), receives each query row's
// log-sum-exp of its scaled scores so that partial results can be merged. window > 0: a sliding window, each
// query token sees only its last `window` keys (itself included), as transformers' sliding-window mask.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& rows, double scale, int64_t start_block, const c10::optional<at::Tensor>& lse,
                     double k_scale, double v_scale, int64_t window, bool amx) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(),
              "K and V caches: [num_blocks, block_size, num_kv_heads, head_dim] with contiguous rows, strided alike");
  TORCH_CHECK(block_table.scalar_type() == at::kInt, "block_table must be int32");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(hq % hkv == 0, "query heads must be a multiple of kv heads");
  const int64_t group = hq / hkv;
  auto bt = block_table.contiguous();
  auto sl = seq_lens.to(at::kLong).contiguous();
  auto qsl = query_start_loc.to(at::kLong).contiguous();
  auto rw = rows.to(at::kLong).contiguous();
  const int64_t* sl_p = sl.data_ptr<int64_t>();
  const int64_t* qsl_p = qsl.data_ptr<int64_t>();
  const int64_t* rw_p = rw.data_ptr<int64_t>();
  const int32_t* bt_p = bt.data_ptr<int32_t>();
  const int64_t bt_stride = bt.size(1), num_rows = rw.size(0);
  float* lse_p = nullptr;
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->size(1) == hq, "lse: [T, Hq] fp32");
    lse_p = lse->data_ptr<float>();
  }
#if defined(__AVX512F__)
  const bool decode_path = d == 64 && block_size == 16 && group <= 4 && q.scalar_type() != at::kDouble &&
                           k_cache.scalar_type() != at::kDouble;
#else
  const bool decode_path = false;
#endif
#if defined(TOKENMILL_DECODE_AMX)
  // bf16 scores on AMX where the CPU has it (amx=false keeps the AVX-512 path, which tests compare with)
  const bool use_amx = amx && decode_path && q.scalar_type() == at::kBFloat16 &&
                       k_cache.scalar_type() == at::kBFloat16 && tokenmill_amx::permitted();
#else
  const bool use_amx = false;
#endif
  // Tasks: (row, kv head, part), and on the decode path (row, token, kv head, part): a few drafts being verified
  // are then as many tasks as their tokens times the KV heads, not one per head, so they spread over the cores
  // (SmolLM2's 3 KV heads were 2 rounds on 2 cores whatever the tokens). A row has more than one part only on
  // the decode path with a long sequence. first_task[r] = the row's first task; its parts of one head are
  // consecutive. part_off[r] = where its tokens' partial results start in `parts` (group * (64 + 2) floats for
  // every task and token).
  // Over a one-byte cache (fp8, int8) with many tokens and none split, a task is a token with all its KV heads
  // (heads_together): each block's heads are then read one after another, not one head's slice of every block
  // per task: a W1 step (128 x 320 tokens) 17.8-18.5 against 19.3-20.3 ms with the blocks in order, 20.6-21.8
  // against 33.9-34.4 scattered (fp8 e4m3; int8 -17% and -47%). Over a bf16 cache it was slower (46.7 against
  // 37.3 ms), so that stays per head (e4626e1:docs/benchmarks/2026-12-04-last-layer). A head's arithmetic is the same
  // either way (never on AMX, whose scores take another form), so a token gets the same bits in any batch.
  std::vector<int64_t> first_task(num_rows + 1, 0), num_parts(num_rows, 1), part_off(num_rows + 1, 0);
  std::vector<bool> per_token(num_rows, false);
  bool any_split = false;
  bool all_per_token = true;
  int64_t decode_tokens = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t i = rw_p[r], q_len = qsl_p[i + 1] - qsl_p[i];
    per_token[r] = decode_path && q_len > 0 && q_len <= kDecodeLoopMaxQueryLen;
    const int64_t walked = sl_p[i] - start_block * block_size;  // the keys the row's tokens walk here (at most)
    if (per_token[r] && walked > kSplitTokens) num_parts[r] = (walked + kSplitTokens - 1) / kSplitTokens;
    any_split |= num_parts[r] > 1;
    all_per_token &= per_token[r] || q_len == 0;
    decode_tokens += q_len;
  }
  const bool heads_together = k_cache.element_size() == 1 && !use_amx && !any_split && all_per_token && hkv >= 2 &&
                              hkv <= kHeadsTogetherMax && decode_tokens >= kHeadsTogetherMinTokens;
  const int64_t head_tasks = heads_together ? 1 : hkv;   // tasks per token (or per row off the decode path)
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t i = rw_p[r], q_len = qsl_p[i + 1] - qsl_p[i];
    first_task[r + 1] = first_task[r] + head_tasks * num_parts[r] * (per_token[r] ? q_len : 1);
    part_off[r + 1] = part_off[r] + (num_parts[r] > 1 ? hkv * num_parts[r] * q_len * group * (d + 2) : 0);
  }
  const int64_t tasks = first_task[num_rows], part_stride = group * (d + 2);
  std::vector<float> parts(any_split ? part_off[num_rows] : 0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    using T = scalar_t;
    auto run = [&](auto kv_tag) {
      using KT = decltype(kv_tag);
      const T* q_p = q.data_ptr<T>();
      T* o_p = out.data_ptr<T>();
      const KT* k_p = reinterpret_cast<const KT*>(k_cache.data_ptr());
      const KT* v_p = reinterpret_cast<const KT*>(v_cache.data_ptr());
      const float qk_scale = static_cast<float>(scale * k_scale), vs = static_cast<float>(v_scale);
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
#if defined(TOKENMILL_DECODE_AMX)
        if (use_amx) tokenmill_amx::configure_tiles();
#endif
        int64_t r = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
        for (int64_t task = begin; task < end; ++task) {
          while (task >= first_task[r + 1]) ++r;
          const int64_t i = rw_p[r], np = num_parts[r], idx = task - first_task[r];
          const int64_t h = idx % (head_tasks * np) / np, part = idx % np;
          const int64_t q0 = qsl_p[i], q_len = qsl_p[i + 1] - q0;
          if (q_len == 0) continue;
#if defined(__AVX512F__)
          // A few new tokens (drafts being verified, a short chunk) go through the decode kernel one token (one
          // task) at a time, each with the context it would have had alone: a token's attention is then the same
          // bits whether it is decoded, verified as a draft or computed in a chunk, so speculation cannot change
          // a greedy answer in bf16 either.
          if (per_token[r]) {
            if constexpr (!std::is_same_v<T, double> && !std::is_same_v<KT, double>) {
              using Fn = void (*)(const T*, T*, const KT*, const KT*, const int32_t*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, float, int64_t, float*, float, int64_t, int64_t, float*, bool);
              const Fn fns[4] = {&decode_d64<T, KT, 1>, &decode_d64<T, KT, 2>, &decode_d64<T, KT, 3>,
                                 &decode_d64<T, KT, 4>};
              const Fn together[3][4] = {  // [KV heads - 2][query heads per KV head - 1]
                  {&decode_d64_heads<T, KT, 1, 2>, &decode_d64_heads<T, KT, 2, 2>, &decode_d64_heads<T, KT, 3, 2>, &decode_d64_heads<T, KT, 4, 2>},
                  {&decode_d64_heads<T, KT, 1, 3>, &decode_d64_heads<T, KT, 2, 3>, &decode_d64_heads<T, KT, 3, 3>, &decode_d64_heads<T, KT, 4, 3>},
                  {&decode_d64_heads<T, KT, 1, 4>, &decode_d64_heads<T, KT, 2, 4>, &decode_d64_heads<T, KT, 3, 4>, &decode_d64_heads<T, KT, 4, 4>}};
              const Fn fn = heads_together ? together[hkv - 2][group - 1] : fns[group - 1];
              const int64_t t = idx / (head_tasks * np), len = sl_p[i] - q_len + t + 1;
              const int64_t walked = len - start_block * block_size;
              const bool split = walked > kSplitTokens;  // this token's own choice (np > 1 then)
              if (split ? part * kSplitTokens >= walked : part > 0) continue;
              float* dst = split ? parts.data() + part_off[r] + ((h * np + part) * q_len + t) * part_stride
                                 : nullptr;
              fn(q_p + (q0 + t) * hq * d, o_p + (q0 + t) * hq * d, k_p, v_p, bt_p + i * bt_stride,
                             len, h, k_cache.stride(1), k_cache.stride(0), k_cache.stride(2), qk_scale,
                             split ? start_block + part * kSplitBlocks : start_block,
                             lse_p ? lse_p + (q0 + t) * hq : nullptr, vs, window,
                             split ? start_block + (part + 1) * kSplitBlocks : -1, dst, use_amx);
              continue;
            }
          }
#endif
          auto* fn = d == 64 ? &attend_one<T, KT, 64> : d == 128 ? &attend_one<T, KT, 128> : &attend_one<T, KT, 0>;
          fn(q_p + q0 * hq * d, o_p + q0 * hq * d, k_p, v_p, bt_p + i * bt_stride, q_len, sl_p[i], group, d,
             block_size, h, hq * d, d, k_cache.stride(1), k_cache.stride(0), k_cache.stride(2), qk_scale,
             start_block,
             lse_p ? lse_p + q0 * hq : nullptr, vs, window);
        }
#if defined(TOKENMILL_DECODE_AMX)
        if (use_amx) _tile_release();
#endif
      });
      if (!any_split) return;
      // the split tokens: each query head's parts merged (a token's parts of one head lie q_len apart)
      at::parallel_for(0, num_rows * hkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / hkv, h = task % hkv, np = num_parts[r], i = rw_p[r];
          if (np == 1) continue;
          const int64_t q0 = qsl_p[i], q_len = qsl_p[i + 1] - q0;
          for (int64_t t = 0; t < q_len; ++t) {
            const int64_t walked = sl_p[i] - q_len + t + 1 - start_block * block_size;
            if (walked <= kSplitTokens) continue;
            const float* first = parts.data() + part_off[r] + (h * np * q_len + t) * part_stride;
            for (int g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              merge_parts(first, (walked + kSplitTokens - 1) / kSplitTokens, q_len * part_stride,
                          static_cast<int>(group), g, vs, o_p + ((q0 + t) * hq + head) * d,
                          lse_p ? lse_p + (q0 + t) * hq + head : nullptr);
            }
          }
        }
      });
    };
    const auto kv = k_cache.scalar_type();
    if (kv == q.scalar_type()) run(T{});
    else if (kv == at::kFloat8_e4m3fn) run(at::Float8_e4m3fn{});
    else if (kv == at::kFloat8_e5m2) run(at::Float8_e5m2{});
    else if (kv == at::kChar) run(int8_t{});
    else TORCH_CHECK(false, "paged_attention: KV cache dtype ", kv, " is not supported with ", q.scalar_type());
  });
}

}  // namespace

namespace tokenmill_native {
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& rows, double scale, int64_t start_block, const c10::optional<at::Tensor>& lse,
                     double k_scale, double v_scale, int64_t window, bool amx) {
  ::paged_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, rows, scale, start_block, lse,
                    k_scale, v_scale, window, amx);
}
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor rows, float scale, int start_block=0, "
        "Tensor(b!)? lse=None, float k_scale=1.0, float v_scale=1.0, int window=0, bool amx=True) -> ()");
}

TM_LIBRARY_IMPL(CPU, m) { m.impl("paged_attention", &paged_attention); }
