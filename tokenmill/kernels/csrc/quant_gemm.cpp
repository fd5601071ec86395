// Weight-only quantized linear layers: y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b, with w kept in 8 or 4 bits.
//
// One layout serves int8 (per channel), int4 (groups with a scale and a minimum) and GGUF's Q8_0 / Q4_0 / Q4_1
// blocks (repacked once at load, value for value): for each block of 16 outputs, k-major, so 16 outputs of one k
// are adjacent and a load advances 16 outputs at once with no horizontal sums (like the bf16 tile layout):
//   8 bits: q [N/16, K, 16] int8, w = scale * q
//   4 bits: q [N/16, K/2, 16] bytes, k even in the low nibble and k odd in the high one, w = scale * q + min
//   scale, min: [N/16, K/G, 16] fp16, one per group of G inputs of each output (G = K for per-channel int8).
// Two kernels read it:
//  - skinny (1-4 rows): dequantizes in registers (bytes -> int32 -> fp32) and accumulates q * x in fp32 per
//    group, then applies the group's scale (and min * the group's sum of x) once per group. The decode step of
//    one stream becomes a stream of 1 or 0.56 bytes a weight instead of 2.
//  - dequantize (a range of output blocks -> w^T [K, rows] bf16): for larger batches, whose matmul is bound by
//    compute, the layer's weights are dequantized into a buffer that stays in cache and oneDNN multiplies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = 16;

struct QuantView {
  const uint8_t* q;
  const uint16_t* scale;
  const uint16_t* min;   // 4 bits only
  int64_t bits, group, k, n;

  int64_t block_bytes() const { return k * kBlockN * bits / 8; }
  int64_t groups() const { return k / group; }
};

QuantView view_of(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& min, int64_t bits,
                  int64_t group, int64_t n, int64_t k) {
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

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 16 outputs' weights of inputs kk and kk + 1 (as integers in fp32) of block b.
template <int BITS>
inline void load_pair(const QuantView& w, int64_t b, int64_t kk, __m512& w0, __m512& w1) {
  if constexpr (BITS == 8) {
    const auto* p = reinterpret_cast<const __m128i*>(w.q + b * w.block_bytes() + kk * kBlockN);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(w.q + b * w.block_bytes() + (kk / 2) * kBlockN);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p));
    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}

// Rows [0, M) x output blocks [b0, b1), J blocks at a time; each (block, row) has two chains (k even, k odd).
template <int M, int J, int BITS>
void skinny_blocks(const QuantView& w, const float* x, const float* xsum, const float* bias, uint16_t* y,
                   int64_t b0, int64_t b1) {
  const int64_t k = w.k, ng = w.groups();
  for (int64_t b = b0; b + J <= b1; b += J) {
    __m512 acc[J][M];
    for (int j = 0; j < J; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m512 even[J][M], odd[J][M];
      for (int j = 0; j < J; ++j)
        for (int m = 0; m < M; ++m) even[j][m] = odd[j][m] = _mm512_setzero_ps();
      for (int64_t kk = g * w.group; kk < (g + 1) * w.group; kk += 2) {
        __m512 x0[M], x1[M];
        for (int m = 0; m < M; ++m) {
          x0[m] = _mm512_set1_ps(x[m * k + kk]);
          x1[m] = _mm512_set1_ps(x[m * k + kk + 1]);
        }
        for (int j = 0; j < J; ++j) {
          __m512 w0, w1;
          load_pair<BITS>(w, b + j, kk, w0, w1);
          for (int m = 0; m < M; ++m) {
            even[j][m] = _mm512_fmadd_ps(w0, x0[m], even[j][m]);
            odd[j][m] = _mm512_fmadd_ps(w1, x1[m], odd[j][m]);
          }
        }
      }
      for (int j = 0; j < J; ++j) {
        const int64_t at = ((b + j) * ng + g) * kBlockN;
        const __m512 s = load_half16(w.scale + at);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(_mm512_add_ps(even[j][m], odd[j][m]), s, acc[j][m]);
        if constexpr (BITS == 4) {
          const __m512 mn = load_half16(w.min + at);
          for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * ng + g]), acc[j][m]);
        }
      }
    }
    for (int j = 0; j < J; ++j) {
      const __m512 bv = bias ? _mm512_loadu_ps(bias + (b + j) * kBlockN) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const __m512 v = _mm512_add_ps(acc[j][m], bv);
        // round to nearest even into bf16
        __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * w.n + (b + j) * kBlockN), _mm512_cvtepi32_epi16(u));
      }
    }
  }
}

template <int M, int BITS>
void skinny_range(const QuantView& w, const float* x, const float* xsum, const float* bias, uint16_t* y,
                  int64_t b0, int64_t b1) {
  constexpr int J = M <= 2 ? 4 : 2;
  const int64_t whole = b0 + (b1 - b0) / J * J;
  skinny_blocks<M, J, BITS>(w, x, xsum, bias, y, b0, whole);
  skinny_blocks<M, 1, BITS>(w, x, xsum, bias, y, whole, b1);
}

template <int BITS>
void skinny_dispatch(int64_t m, const QuantView& w, const float* x, const float* xsum, const float* bias, uint16_t* y,
                     int64_t b0, int64_t b1) {
  switch (m) {
    case 1: skinny_range<1, BITS>(w, x, xsum, bias, y, b0, b1); break;
    case 2: skinny_range<2, BITS>(w, x, xsum, bias, y, b0, b1); break;
    case 3: skinny_range<3, BITS>(w, x, xsum, bias, y, b0, b1); break;
    default: skinny_range<4, BITS>(w, x, xsum, bias, y, b0, b1); break;
  }
}

at::Tensor quant_skinny_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                             int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_skinny_gemm: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= 4, "quant_skinny_gemm: 1 to 4 rows");
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor xsum = xf.view({m, k / group, group}).sum(-1).contiguous();
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "quant_skinny_gemm: bias must be [N]");
    bf = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / kBlockN, 4, [&](int64_t b0, int64_t b1) {
    if (bits == 8) skinny_dispatch<8>(m, w, xp, sp, bp, yp, b0, b1);
    else skinny_dispatch<4>(m, w, xp, sp, bp, yp, b0, b1);
  });
  return y;
}

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
        const __m512 mn = bits == 4 ? load_half16(w.min + at) : _mm512_setzero_ps();
        for (int64_t kk = g * group; kk < (g + 1) * group; kk += 2) {
          __m512 w0, w1;
          if (bits == 8) load_pair<8>(w, b, kk, w0, w1);
          else load_pair<4>(w, b, kk, w0, w1);
          const __m512 v0 = _mm512_fmadd_ps(w0, s, mn), v1 = _mm512_fmadd_ps(w1, s, mn);
          // both rounded to nearest even, as torch's fp32 -> bf16 conversion rounds
          const __m512i r0 = _mm512_castps_si512(v0), r1 = _mm512_castps_si512(v1);
          const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
          const __m512i u0 = _mm512_srli_epi32(
              _mm512_add_epi32(r0, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(r0, 16), one), half)), 16);
          const __m512i u1 = _mm512_srli_epi32(
              _mm512_add_epi32(r1, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(r1, 16), one), half)), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + kk * cols), _mm512_cvtepi32_epi16(u0));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + (kk + 1) * cols), _mm512_cvtepi32_epi16(u1));
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_skinny_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, "
        "int n) -> Tensor");
  m.def("quant_dequantize_t(Tensor q, Tensor scale, Tensor? min, int bits, int group, int n, int k, int b0, "
        "int b1) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_skinny_gemm", &quant_skinny_gemm);
  m.impl("quant_dequantize_t", &quant_dequantize_t);
}

#endif
