// bf16 matrix products for a few rows (decode steps of small batches): y[M, N] = x[M, K] @ w[N, K]^T + b.
//
// At M <= 4 a linear layer is a pure weight stream: each weight byte is used M times. oneDNN's blocked
// kernels pay a fixed cost per call that dominates at SmolLM2's small shapes (they stream ~14 GB/s here);
// reading w's rows in place with `vdpbf16ps` and one fp32 accumulator per (row, input) reaches ~35 GB/s.
// Each thread takes a contiguous range of rows, so every thread reads one sequential stream.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kRowsPerGroup = 4;
constexpr int64_t kPrefetchRows = 4;

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int M>
void rows_times_inputs(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0,
                       int64_t n1, int64_t k, int64_t n) {
  const int64_t full = k / 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << (k % 32)) - 1);
  __m512bh xv_tail[M];
  for (int m = 0; m < M; ++m) xv_tail[m] = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, x + m * k + full * 32);
  for (int64_t row = n0; row < n1; row += kRowsPerGroup) {
    const int64_t rows = std::min(kRowsPerGroup, n1 - row);
    __m512 acc[kRowsPerGroup][M];
    for (int r = 0; r < kRowsPerGroup; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; ++c) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * k + c * 32);
      for (int r = 0; r < kRowsPerGroup; ++r) {
        if (r >= rows) break;
        const uint16_t* wp = w + (row + r) * k + c * 32;
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * k), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    if (tail_mask) {
      for (int r = 0; r < rows; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, w + (row + r) * k + full * 32);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv_tail[m]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float b = bias ? bf16_to_float(bias[row + r]) : 0.0f;
      for (int m = 0; m < M; ++m) y[m * n + row + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b).x;
    }
  }
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_gemm: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_gemm: bf16 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "skinny_gemm: 1 to 4 rows");
  TORCH_CHECK(w.is_contiguous(), "skinny_gemm: w must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto xc = x.contiguous();
  auto y = at::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const uint16_t* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "skinny_gemm: bias must be bf16 [N]");
    bc = bias->contiguous();
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t groups = (n + kRowsPerGroup - 1) / kRowsPerGroup;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kRowsPerGroup, n1 = std::min(n, g1 * kRowsPerGroup);
    switch (m) {
      case 1: rows_times_inputs<1>(xp, wp, bp, yp, n0, n1, k, n); break;
      case 2: rows_times_inputs<2>(xp, wp, bp, yp, n0, n1, k, n); break;
      case 3: rows_times_inputs<3>(xp, wp, bp, yp, n0, n1, k, n); break;
      default: rows_times_inputs<4>(xp, wp, bp, yp, n0, n1, k, n); break;
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("skinny_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("skinny_gemm", &skinny_gemm); }

#endif
