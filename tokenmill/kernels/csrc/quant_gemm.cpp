// Weight-only quantized linear layers: y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b, with w kept in 8 or 4 bits
// in the layout of quant_layout.h.
// Two kernels here read it (and quant_tiles.cpp's tile matmul over dequantized panels, for larger batches):
//  - VNNI (small batches): the rows of x become two int8 parts per 32 inputs (hi, and the remainder
//    in 1/256ths: x is kept finer than its own bf16 rounding, unlike llama.cpp's single int8), each block's
//    products are summed exactly in int32 with vpdpbusd, then scaled in fp32; the min term is min * the
//    group's float sum of x, and the +128 of 8-bit weights is taken out with the block's sum of x. A block's
//    weights stay in L1 while every 4-row tile of x passes over it, so the weights stream from
//    memory once per call: one decode step reads ~1 or ~0.56 bytes a weight instead of 2.
//  - dequantize (a range of output blocks -> w^T [K, rows] bf16): for an AMX host's largest batches, a layer's
//    weights are dequantized into a buffer that stays in cache and oneDNN multiplies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "quant_layout.h"

namespace {

using namespace tokenmill_quant;

// Software prefetch. A 16-output block is a stream of only a few KB (and its scales and minima two more, of 32
// bytes a group): at one or two rows the hardware prefetcher ramps up too late in each, so a decode step's
// loads wait on memory. Each weight load asks for the same line of the next tile's stream into L2 (tiles are
// contiguous, so that is one block further on), the scales and minima are asked for kPrefetchGroups groups
// ahead, and a thread's first tile is asked for whole before it starts: the short streams of a tile each began
// with a wait on memory, and a core then kept too few lines in flight to read faster than ~10 GB/s (AMD EPYC,
// 1 row, a step's 120 matmuls: int4 3.3-3.7 -> 2.6 ms, int8 5.1-5.2 -> 4.0). The weights were also asked into
// L1 1 KB ahead of each load; with the L2 requests that no longer helped and cost instructions (AMD Zen 5, the
// 120 matmuls alone, alternated: int8 1.78-1.85 -> 1.61-1.64 ms, int4 1.19-1.44 -> 1.14-1.40; the int8 lm head
// 0.45 -> 0.41).
constexpr int64_t kPrefetchGroups = 4;

inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// The rows of x as integers for the byte dot products, per block of 32 inputs: x ~ d * (hi + lo / 256) with hi
// and lo int8 (hi = round(x / d), d = amax / 127; lo = the rounded remainder in 1/256ths), so the products are
// exact integer sums and x is kept to ~1.5e-5 of its block's largest value: finer than its own bf16 rounding.
// Also: each block's sum 256 hi + lo (for the +128 of 8-bit weights) and the float sum of each weight group
// (for the 4-bit minimum).
struct QuantRows {
  std::vector<int8_t> hi, lo;  // [M, K]
  std::vector<float> scale;    // [M, K/32]: d / 256
  std::vector<int32_t> qsum;   // [M, K/32]
  std::vector<float> gsum;     // [M, K/G]
};

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Filled in place (the caller's thread-local buffers: a decode step makes ~120 of these calls, and their fixed
// costs, allocations included, are a visible share of its time).
void quantize_rows(QuantRows& r, const uint16_t* x, int64_t m, int64_t k, int64_t group) {
  const int64_t nb = k / 32;
  r.hi.resize(m * k);
  r.lo.resize(m * k);
  r.scale.resize(m * nb);
  r.qsum.resize(m * nb);
  r.gsum.assign(m * k / group, 0.0f);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* xb = x + i * k + b * 32;
        const __m512 v0 = load_bf16x16(xb), v1 = load_bf16x16(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        int32_t qs = 0;
        for (int h = 0; h < 2; ++h) {
          const __m512 t = _mm512_mul_ps(h ? v1 : v0, inv);
          const __m512i hi = _mm512_cvtps_epi32(t);  // round half to even
          const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(hi)), _mm512_set1_ps(256.0f));
          const __m512i lo = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(rest), _mm512_set1_epi32(127)),
                                              _mm512_set1_epi32(-127));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.hi.data() + i * k + b * 32 + 16 * h),
                           _mm512_cvtsepi32_epi8(hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.lo.data() + i * k + b * 32 + 16 * h),
                           _mm512_cvtsepi32_epi8(lo));
          qs += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
        }
        r.scale[i * nb + b] = amax / 127.0f / 256.0f;
        r.qsum[i * nb + b] = qs;
        r.gsum[i * (k / group) + b * 32 / group] += _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      }
  });
}


inline void store_bf16(uint16_t* y, __m512 v) {  // round to nearest even
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(u));
#endif
}

#if defined(__AVX512VNNI__)

// Rows [r0, r0 + M) x output blocks [b, b + J), J = 1 (one stream: gemm_range says why). Per 32-input block:
// int32 sums of weight x hi and weight x lo (vpdpbusd), combined exactly as 256 hi-sum + lo-sum, then scaled
// in fp32.
// stream: this tile is the first over its weights, which come from memory; the later row tiles find them in
// L1, where prefetching ahead only costs instructions (256 rows of int8 looked ~15% slower with it).
template <int M, int BITS>
void tile(const QuantView& w, const QuantRows& a, int64_t r0, const float* bias, uint16_t* y, int64_t b,
          bool stream) {
  constexpr int J = 1;
  const int64_t k = w.k, ng = w.groups(), nb32 = k / 32, per_group = w.group / 32;
  __m512 acc[J][M];
  for (int j = 0; j < J; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 sc[J];
    for (int j = 0; j < J; ++j) {
      sc[j] = load_half16(w.scale + ((b + j) * ng + g) * kBlockN);
      if (stream) {
        prefetch(w.scale + ((b + j) * ng + g + kPrefetchGroups) * kBlockN);
        prefetch_l2(w.scale + ((b + j + J) * ng + g) * kBlockN);
        if constexpr (BITS == 4) {
          prefetch(w.min + ((b + j) * ng + g + kPrefetchGroups) * kBlockN);
          prefetch_l2(w.min + ((b + j + J) * ng + g) * kBlockN);
        }
      }
    }
    for (int64_t blk = g * per_group; blk < (g + 1) * per_group; ++blk) {
      __m512i ih[J][M], il[J][M];
      const int32_t *xh[M], *xl[M];
      for (int m = 0; m < M; ++m) {
        xh[m] = reinterpret_cast<const int32_t*>(a.hi.data() + (r0 + m) * k + blk * 32);
        xl[m] = reinterpret_cast<const int32_t*>(a.lo.data() + (r0 + m) * k + blk * 32);
        for (int j = 0; j < J; ++j) ih[j][m] = il[j][m] = _mm512_setzero_si512();
      }
      if constexpr (BITS == 8) {
        for (int s = 0; s < 8; ++s)
          for (int j = 0; j < J; ++j) {
            const uint8_t* at = w.q + (b + j) * w.block_bytes() + (blk * 8 + s) * 64;
            if (stream) prefetch_l2(at + J * w.block_bytes());
            const __m512i wv = _mm512_loadu_si512(at);
            for (int m = 0; m < M; ++m) {
              ih[j][m] = _mm512_dpbusd_epi32(ih[j][m], wv, _mm512_set1_epi32(xh[m][s]));
              il[j][m] = _mm512_dpbusd_epi32(il[j][m], wv, _mm512_set1_epi32(xl[m][s]));
            }
          }
      } else {
        for (int s = 0; s < 8; s += 2)
          for (int j = 0; j < J; ++j) {
            const uint8_t* at = w.q + (b + j) * w.block_bytes() + (blk * 4 + s / 2) * 64;
            if (stream) prefetch_l2(at + J * w.block_bytes());
            const __m512i v = _mm512_loadu_si512(at);
            const __m512i lo = low_nibbles(v), hi = high_nibbles(v);
            for (int m = 0; m < M; ++m) {
              ih[j][m] = _mm512_dpbusd_epi32(ih[j][m], lo, _mm512_set1_epi32(xh[m][s]));
              ih[j][m] = _mm512_dpbusd_epi32(ih[j][m], hi, _mm512_set1_epi32(xh[m][s + 1]));
              il[j][m] = _mm512_dpbusd_epi32(il[j][m], lo, _mm512_set1_epi32(xl[m][s]));
              il[j][m] = _mm512_dpbusd_epi32(il[j][m], hi, _mm512_set1_epi32(xl[m][s + 1]));
            }
          }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(a.scale[(r0 + m) * nb32 + blk]);
        // 8-bit weights are stored as q + 128: take 128 x the block's sum of x back out
        const __m512i offset = BITS == 8 ? _mm512_set1_epi32(-128 * a.qsum[(r0 + m) * nb32 + blk])
                                         : _mm512_setzero_si512();
        for (int j = 0; j < J; ++j) {
          const __m512i total = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(ih[j][m], 8), il[j][m]), offset);
          acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(xs, sc[j]), acc[j][m]);
        }
      }
    }
    if constexpr (BITS == 4) {
      for (int j = 0; j < J; ++j) {
        const __m512 mn = load_half16(w.min + ((b + j) * ng + g) * kBlockN);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.gsum[(r0 + m) * ng + g]), acc[j][m]);
      }
    }
  }
  for (int j = 0; j < J; ++j) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + (b + j) * kBlockN) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store_bf16(y + (r0 + m) * w.n + (b + j) * kBlockN, _mm512_add_ps(acc[j][m], bv));
  }
}

template <int BITS>
void tile_rows(int64_t rows, const QuantView& w, const QuantRows& a, int64_t r0, const float* bias, uint16_t* y,
               int64_t b) {
  const bool stream = r0 == 0;
  switch (rows) {
    case 1: tile<1, BITS>(w, a, r0, bias, y, b, stream); break;
    case 2: tile<2, BITS>(w, a, r0, bias, y, b, stream); break;
    case 3: tile<3, BITS>(w, a, r0, bias, y, b, stream); break;
    default: tile<4, BITS>(w, a, r0, bias, y, b, stream); break;
  }
}

// Output blocks [b0, b1) for all m rows, one block at a time: its weights (a few KB) stay in L1 while every
// 4-row tile of x (from L2) passes over them, so the weights are read from memory once per call whatever the
// batch. One block per tile, one stream: two or four blocks side by side (J > 1) read slower on AMD Zen 5
// (a step's 120 linears at one row: int8 2.9-3.2 -> 2.7 ms, int4 1.75-2.0 -> 1.6-1.8; at two rows int8
// 3.4-3.5 -> 3.1, int4 equal; the tied lm head in int8 0.78 -> 0.65 ms) and equal on Zen 4.
template <int BITS>
void gemm_range(int64_t m, const QuantView& w, const QuantRows& a, const float* bias, uint16_t* y, int64_t b0,
                int64_t b1) {
  constexpr int kRows = 4;
  {  // the first tile has no tile before it to ask for its lines: ask for them all at once
    const int64_t ng = w.groups();
    for (const uint8_t* p = w.q + b0 * w.block_bytes(); p < w.q + (b0 + 1) * w.block_bytes(); p += 64)
      prefetch_l2(p);
    for (int64_t i = b0 * ng * kBlockN; i < (b0 + 1) * ng * kBlockN; i += 32) {  // 32 fp16 values: one line
      prefetch_l2(w.scale + i);
      if constexpr (BITS == 4) prefetch_l2(w.min + i);
    }
  }
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < m; r += kRows) tile_rows<BITS>(std::min<int64_t>(kRows, m - r), w, a, r, bias, y, b);
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                             int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_gemm: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "quant_gemm: no rows");
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  const at::Tensor xc = x.contiguous();
  // the calling thread's buffers, passed by pointer: inside the parallel lambdas the name of a thread_local
  // would mean each worker's own (empty) instance
  thread_local QuantRows buffers;
  const QuantRows* rows = &buffers;
  quantize_rows(buffers, reinterpret_cast<const uint16_t*>(xc.data_ptr()), m, k, group);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "quant_gemm: bias must be [N]");
    bf = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / kBlockN, 4, [&](int64_t b0, int64_t b1) {
    if (bits == 8) gemm_range<8>(m, w, *rows, bp, yp, b0, b1);
    else gemm_range<4>(m, w, *rows, bp, yp, b0, b1);
  });
  return y;
}

#endif  // __AVX512VNNI__

// Output blocks [b0, b1) dequantized to w^T: [K, (b1 - b0) * 16] bf16, ready for x @ w^T.
at::Tensor quant_dequantize_t(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                              int64_t bits, int64_t group, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  TORCH_CHECK(0 <= b0 && b0 < b1 && b1 <= n / kBlockN, "quant_dequantize_t: block range out of bounds");
  const int64_t cols = (b1 - b0) * kBlockN, ng = w.groups();
  auto out = at::empty({k, cols}, at::TensorOptions().dtype(at::kBFloat16));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(b0, b1, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t b = c0; b < c1; ++b) {
      uint16_t* col = op + (b - b0) * kBlockN;
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t at = (b * ng + g) * kBlockN;
        const __m512 s = load_half16(w.scale + at);
        // 8-bit values are stored as q + 128: w = s * stored - 128 s
        const __m512 mn = bits == 4 ? load_half16(w.min + at) : _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
        for (int64_t kk = g * group; kk < (g + 1) * group; kk += 8) {
          __m512 v[8];
          dequantize8(w, b, kk, s, mn, v);
          for (int e = 0; e < 8; ++e) store_bf16(col + (kk + e) * cols, v[e]);
        }
      }
    }
  });
  return out;
}

}  // namespace

#if defined(__AVX512VNNI__)
namespace tokenmill_native {
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                      int64_t group, int64_t n) {
  return ::quant_gemm(x, q, scale, min, bias, bits, group, n);
}
}  // namespace tokenmill_native
#endif

TM_LIBRARY_FRAGMENT(m) {
#if defined(__AVX512VNNI__)
  m.def("quant_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, "
        "int n) -> Tensor");
#endif
  m.def("quant_dequantize_t(Tensor q, Tensor scale, Tensor? min, int bits, int group, int n, int k, int b0, "
        "int b1) -> Tensor");
}
TM_LIBRARY_IMPL(CPU, m) {
#if defined(__AVX512VNNI__)
  m.impl("quant_gemm", &quant_gemm);
#endif
  m.impl("quant_dequantize_t", &quant_dequantize_t);
}

#endif
