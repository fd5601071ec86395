// The elementwise work around the matmuls, one pass each over bf16 rows, fp32 inside, rounded once:
//   rms_norm            out = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm        residual += x; x = rms_norm(residual)       (both in place)
//   silu_and_mul        out = silu(gate) * up, from the fused [T, 2I] gate_up product
//   rope_and_cache      q_out = rope(q); k = rope(k) in place; K/V written to their paged-cache slots (bf16, or
//                       quantized: value / scale saturated to fp8 e4m3, fp8 e5m2 or int8, rounded to nearest even;
//                       K less its per-channel offset first, when one is given)
//   argmax_rows         greedy sampling straight from bf16 logits (first maximum on ties)
// Eager torch spends more time dispatching these (5-10 small ops each) than computing them at decode sizes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "bf16_rows.h"
#include "vec_math.h"
#include "rope_cache.h"

namespace {

// One row: optional residual add (stored back), then the norm. `sum` first, so the row is read twice from L1.
inline void norm_row(bf16* out, const bf16* x, bf16* residual, const bf16* w, int64_t d, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 mk = mask_at(j, d);
    __m512 v = load16(x + j, mk);
    if (residual) {
      // the sum rounded to bf16, as the unfused model sees it: rounded in registers (reading it back from the
      // masked store waited on store forwarding, ~8x the norm's arithmetic)
      v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_add_ps(v, load16(residual + j, mk))));
      store16(residual + j, v, mk);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
  const bf16* src = residual ? residual : x;
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 mk = mask_at(j, d);
    store16(out + j, _mm512_mul_ps(_mm512_mul_ps(load16(src + j, mk), r), load16(w + j, mk)), mk);
  }
}

using tm_rope::check_rows;

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t d = x.size(1);
  auto* op = reinterpret_cast<bf16*>(out.data_ptr());
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const bf16*>(w.data_ptr());
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      norm_row(op + t * out.stride(0), xp + t * x.stride(0), nullptr, wp, d, static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t d = x.size(1);
  auto* xp = reinterpret_cast<bf16*>(x.data_ptr());
  auto* rp = reinterpret_cast<bf16*>(residual.data_ptr());
  const auto* wp = reinterpret_cast<const bf16*>(w.data_ptr());
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      bf16* row = xp + t * x.stride(0);
      norm_row(row, row, rp + t * residual.stride(0), wp, d, static_cast<float>(eps));
    }
  });
}

// silu(g) = g / (1 + exp(-g)), with exp512 from vec_math.h.

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t d = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * d && x.size(0) == out.size(0), "silu_and_mul: x is [T, 2D], out [T, D]");
  auto* op = reinterpret_cast<bf16*>(out.data_ptr());
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr());
  at::parallel_for(0, x.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const bf16* g = xp + t * x.stride(0);
      bf16* o = op + t * out.stride(0);
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 mk = mask_at(j, d);
        store16(o + j, _mm512_mul_ps(silu512(load16(g + j, mk)), load16(g + d + j, mk)), mk);
      }
    }
  });
}

// rotate-half rope on one head: out[j] = x[j] cos[j] - x[j+h] sin[j], out[j+h] = x[j+h] cos[j+h] + x[j] sin[j+h].
inline void rope_head(bf16* out, const bf16* x, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; j += 16) {
    const __mmask16 mk = mask_at(j, h);
    const __m512 a = load16(x + j, mk), b = load16(x + h + j, mk);
    const __m512 lo = _mm512_fnmadd_ps(b, _mm512_maskz_loadu_ps(mk, sin + j), _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, cos + j)));
    const __m512 hi = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(mk, sin + h + j),
                                      _mm512_mul_ps(b, _mm512_maskz_loadu_ps(mk, cos + h + j)));
    store16(out + j, lo, mk);
    store16(out + h + j, hi, mk);
  }
}

// Quantized cache values from 16 fp32 values already divided by their scale: saturated to the format's range and
// rounded to nearest even. fp8 goes through fp16 (e5m2 is fp16's top byte; e4m3 is fp16 of x / 2^8 shifted down
// by 7 bits), which handles the subnormals with no special case.
using KvFormat = tm_rope::CacheFormat;

inline __m128i round_fp16_down(__m256i h, int shift) {  // round-to-nearest-even drop of `shift` low bits
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(h, shift), _mm256_set1_epi16(1));
  const __m256i half = _mm256_set1_epi16(static_cast<int16_t>((1 << (shift - 1)) - 1));
  return _mm256_cvtepi16_epi8(_mm256_srli_epi16(_mm256_add_epi16(h, _mm256_add_epi16(half, lsb)), shift));
}

template <KvFormat F>
inline __m128i encode16(__m512 v) {
  if constexpr (F == KvFormat::kInt8) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
  } else if constexpr (F == KvFormat::kE5M2) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-57344.0f)), _mm512_set1_ps(57344.0f));
    return round_fp16_down(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 8);
  } else {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(v, _mm512_set1_ps(1.0f / 256.0f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i mag = round_fp16_down(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)), 7);
    const __m128i sign = _mm256_cvtepi16_epi8(_mm256_and_si256(_mm256_srli_epi16(h, 8), _mm256_set1_epi16(0x80)));
    return _mm_or_si128(mag, sign);
  }
}

// n (a multiple of 16) bf16 values into the cache row `dst` in format F; a quantized row stores
// (value - offset) / scale where an offset row (n fp32) is given.
template <KvFormat F>
inline void store_cache_row(void* dst, const bf16* src, int64_t n, float inv_scale, const float* offset = nullptr) {
  if constexpr (F == KvFormat::kBF16) {
    std::memcpy(dst, src, n * sizeof(bf16));
  } else {
    auto* out = reinterpret_cast<uint8_t*>(dst);
    for (int64_t j = 0; j < n; j += 16) {
      __m512 x = load16(src + j, 0xFFFF);
      if (offset) x = _mm512_sub_ps(x, _mm512_loadu_ps(offset + j));
      const __m512 v = _mm512_mul_ps(x, _mm512_set1_ps(inv_scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), encode16<F>(v));
    }
  }
}

void rope_and_cache(at::Tensor q_out, at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    int64_t hq, int64_t hkv, double k_scale, double v_scale,
                    const c10::optional<at::Tensor>& k_offset) {
  const float* ko = tm_rope::check_rope_and_cache(q_out, qkv, cos, sin, k_cache, v_cache, hq, hkv, k_offset);
  tm_rope::by_cache_dtype(k_cache.scalar_type(), [&](auto format) {
    tm_rope::rope_and_cache_rows(q_out, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv,
                                 static_cast<float>(k_scale), static_cast<float>(v_scale), ko, rope_head,
                                 store_cache_row<decltype(format)::value>);
  });
}

// The index of each row's largest value (the first one on ties), without converting the logits to fp32.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t b = logits.size(0), v = logits.size(1);
  auto out = at::empty({b}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const auto* lp = reinterpret_cast<const bf16*>(logits.data_ptr());
  at::parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* row = lp + r * logits.stride(0);
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i best_idx = _mm512_set1_epi32(0);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      for (int64_t j = 0; j < v; j += 16) {
        const __m512 x = load16(row + j, mask_at(j, v));
        const __mmask16 mask = _mm512_mask_cmp_ps_mask(mask_at(j, v), x, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, mask, x);
        best_idx = _mm512_mask_mov_epi32(best_idx, mask, idx);
        idx = _mm512_add_epi32(idx, step);
      }
      const float top = _mm512_reduce_max_ps(best);
      const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
      op[r] = _mm512_mask_reduce_min_epi32(at_top, best_idx);
    }
  });
  return out;
}

}  // namespace

namespace tokenmill_native {
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) { ::rms_norm(out, x, w, eps); }
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  ::add_rms_norm(x, residual, w, eps);
}
void silu_and_mul(at::Tensor out, const at::Tensor& x) { ::silu_and_mul(out, x); }
void rope_and_cache(at::Tensor q_out, at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    int64_t hq, int64_t hkv, double k_scale, double v_scale,
                    const c10::optional<at::Tensor>& k_offset) {
  ::rope_and_cache(q_out, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv, k_scale, v_scale,
                   k_offset);
}
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rope_and_cache(Tensor(a!) q_out, Tensor(b!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, int hq, int hkv, float k_scale=1.0, "
        "float v_scale=1.0, Tensor? k_offset=None) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TM_LIBRARY_IMPL(CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("argmax_rows", &argmax_rows);
}

#endif
