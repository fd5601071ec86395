// W8A8's two passes around oneDNN's int8 GEMM (layers/quant/w8a8.py), each one read and one write per element
// where torch takes four to five passes and a temporary the size of the output:
//   w8a8_quantize_rows: x [M, K] (bf16 or fp32) -> int8 q [M, K] and fp32 scales [M, 1], q = round(x / s),
//                       s = max|x_row| / 127 (at least 1e-8 / 127)
//   w8a8_scale_rows:    acc [M, N] int32 -> out [M, N] = acc * sx[m] * sw[n] (+ bias[n]) in bf16 or fp32
// Plain loops the compiler vectorizes (-O3 -march=native): no instruction set is required.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {   // (the bits shifted: a form the compiler vectorizes)
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row at a time, 16 values a step: the row's largest magnitude, then q = round(x * 127 / max) (half to
// even, as torch.round), saturated to [-127, 127].
template <typename T>
void quantize_rows_avx512(const T* x, int8_t* q, float* s, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * k;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 16) {
        const __mmask16 m = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xr + c, m)));
      }
      const float scale = std::max(_mm512_reduce_max_ps(mx), 1e-8f) / 127.f;
      const __m512 sv = _mm512_set1_ps(scale);
      for (int64_t c = 0; c < k; c += 16) {
        const __mmask16 m = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
        __m512 v = _mm512_div_ps(load16(xr + c, m), sv);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f), v));
        _mm_mask_storeu_epi8(q + r * k + c, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
      }
      s[r] = scale;
    }
  });
}
#endif

template <typename T>
void quantize_rows(const T* x, int8_t* q, float* s, int64_t rows, int64_t k) {
#if defined(__AVX512F__)
  quantize_rows_avx512(x, q, s, rows, k);
  return;
#endif
  constexpr float kRound = 12582912.f;   // 1.5 * 2^23: adding and taking it off rounds half to even, as torch
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * k;
      float amax = 0.f;
      for (int64_t c = 0; c < k; ++c) {
        const float a = to_float(xr[c]);
        amax = std::max(amax, a < 0.f ? -a : a);
      }
      const float scale = std::max(amax, 1e-8f) / 127.f;
      int8_t* qr = q + r * k;
      for (int64_t c = 0; c < k; ++c) {
        float v = to_float(xr[c]) / scale;
        v = (v + kRound) - kRound;
        v = std::min(127.f, std::max(-127.f, v));
        qr[c] = static_cast<int8_t>(static_cast<int32_t>(v));
      }
      s[r] = scale;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "w8a8_quantize_rows: x must be 2-D");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), rows, k);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "w8a8_quantize_rows: x must be bf16 or fp32");
    quantize_rows(x.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), rows, k);
  }
  return {q, s};
}

template <typename T>
void scale_rows(const int32_t* acc, const float* sx, const float* sw, const float* bias, T* out, int64_t rows,
                int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int32_t* ar = acc + r * n;
      T* orow = out + r * n;
      const float f = sx[r];
      if (bias != nullptr) {
        for (int64_t c = 0; c < n; ++c) orow[c] = static_cast<T>(static_cast<float>(ar[c]) * f * sw[c] + bias[c]);
      } else {
        for (int64_t c = 0; c < n; ++c) orow[c] = static_cast<T>(static_cast<float>(ar[c]) * f * sw[c]);
      }
    }
  });
}

at::Tensor w8a8_scale_rows(const at::Tensor& acc_in, const at::Tensor& sx, const at::Tensor& sw,
                           const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  TORCH_CHECK(acc_in.dim() == 2 && acc_in.scalar_type() == at::kInt, "w8a8_scale_rows: acc must be 2-D int32");
  const at::Tensor acc = acc_in.contiguous();
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(sx.numel() == rows && sw.numel() == n, "w8a8_scale_rows: scale sizes do not match acc");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sw.scalar_type() == at::kFloat, "w8a8_scale_rows: fp32 scales");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "w8a8_scale_rows: fp32 bias of N");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, acc.options().dtype(dtype));
  const at::Tensor sxc = sx.contiguous(), swc = sw.contiguous();
  if (dtype == at::kBFloat16) {
    scale_rows(acc.data_ptr<int32_t>(), sxc.data_ptr<float>(), swc.data_ptr<float>(), b,
               out.data_ptr<at::BFloat16>(), rows, n);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "w8a8_scale_rows: bf16 or fp32 output");
    scale_rows(acc.data_ptr<int32_t>(), sxc.data_ptr<float>(), swc.data_ptr<float>(), b, out.data_ptr<float>(),
               rows, n);
  }
  return out;
}

}  // namespace

TM_LIBRARY_FRAGMENT(m) {
  m.def("w8a8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("w8a8_scale_rows(Tensor acc, Tensor sx, Tensor sw, Tensor? bias, ScalarType dtype) -> Tensor");
}

TM_LIBRARY_IMPL(CPU, m) {
  m.impl("w8a8_quantize_rows", &w8a8_quantize_rows);
  m.impl("w8a8_scale_rows", &w8a8_scale_rows);
}
