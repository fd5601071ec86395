// The portable kernels (portable_kernels.h: AVX2 or ARM NEON) as the ops the Python layers call, under the names
// and signatures of the AVX-512 ones, for a build whose flags give no AVX-512 BF16 / VNNI: the native build on
// such a CPU, or the AVX2-only build that --cpu-isa avx2 loads (ops_library.h). Each group of ops is compiled
// exactly where its AVX-512 counterpart is not, so a build never registers a name twice.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"

#include "portable_kernels.h"
#include "quant_args.h"
#include "rope_cache.h"

#if defined(TM_SIMD8)

#if !defined(__AVX512BF16__)
#define TM_PORTABLE_BF16 1       // norms, rope, silu, argmax and the bf16 tile matmuls (else fused_ops, tiled_gemm)
#endif
#if !defined(__AVX512VNNI__)
#define TM_PORTABLE_QUANT_GEMM 1  // the quantized matmul of small batches (else quant_gemm.cpp)
#endif
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#define TM_PORTABLE_QUANT_TILES 1  // the quantized matmul of larger batches (else quant_tiles.cpp)
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
#define TM_PORTABLE_DEQUANT 1    // dequantize to w^T for oneDNN (else quant_gemm.cpp)
#endif

namespace {

using namespace tm_portable;
using tokenmill_quant::view_of;

using tm_rope::check_rows;
bf16* rows_of(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must be [N]");
  return bias->to(at::kFloat).contiguous();
}

#if defined(TM_PORTABLE_BF16)

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t d = x.size(1);
  const bf16* wp = rows_of(w);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      norm_row(rows_of(out) + t * out.stride(0), rows_of(x) + t * x.stride(0), nullptr, wp, d, static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t d = x.size(1);
  const bf16* wp = rows_of(w);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      bf16* row = rows_of(x) + t * x.stride(0);
      norm_row(row, row, rows_of(residual) + t * residual.stride(0), wp, d, static_cast<float>(eps));
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t d = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * d && x.size(0) == out.size(0), "silu_and_mul: x is [T, 2D], out [T, D]");
  at::parallel_for(0, x.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const bf16* g = rows_of(x) + t * x.stride(0);
      silu_mul_row(rows_of(out) + t * out.stride(0), g, g + d, d);
    }
  });
}

// One cache row: bf16 as it is, or quantized ((value - offset) / scale, saturated, rounded to nearest even).
template <typename KT>
void store_cache_row(void* dst, const bf16* src, int64_t n, float inv_scale, const float* offset) {
  if constexpr (std::is_same_v<KT, at::BFloat16>) {
    std::memcpy(dst, src, n * sizeof(bf16));
  } else {
    auto* out = reinterpret_cast<KT*>(dst);
    for (int64_t j = 0; j < n; ++j) {
      float v = (bf16_to_float(src[j]) - (offset ? offset[j] : 0.0f)) * inv_scale;
      if constexpr (std::is_same_v<KT, int8_t>) {
        out[j] = static_cast<int8_t>(round_to_int(std::max(-127.0f, std::min(127.0f, v))));
      } else {
        const float top = std::is_same_v<KT, at::Float8_e4m3fn> ? 448.0f : 57344.0f;
        out[j] = KT(std::max(-top, std::min(top, v)));
      }
    }
  }
}

// Each cache format's element type.
template <tm_rope::CacheFormat F>
using CacheType = std::conditional_t<
    F == tm_rope::CacheFormat::kBF16, at::BFloat16,
    std::conditional_t<F == tm_rope::CacheFormat::kE4M3, at::Float8_e4m3fn,
                       std::conditional_t<F == tm_rope::CacheFormat::kE5M2, at::Float8_e5m2, int8_t>>>;

void rope_and_cache(at::Tensor q_out, at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    int64_t hq, int64_t hkv, double k_scale, double v_scale,
                    const c10::optional<at::Tensor>& k_offset) {
  const float* ko = tm_rope::check_rope_and_cache(q_out, qkv, cos, sin, k_cache, v_cache, hq, hkv, k_offset);
  tm_rope::by_cache_dtype(k_cache.scalar_type(), [&](auto format) {
    tm_rope::rope_and_cache_rows(q_out, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv,
                                 static_cast<float>(k_scale), static_cast<float>(v_scale), ko, rope_head,
                                 store_cache_row<CacheType<decltype(format)::value>>);
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t b = logits.size(0), v = logits.size(1);
  auto out = at::empty({b}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(rows_of(logits) + r * logits.stride(0), v);
  });
  return out;
}

// w [N, K] -> [N / 16, K / 2, 16, 2]: per block of 16 outputs, each (k, k + 1) pair of the 16 side by side.
at::Tensor pack_tiles(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_tiles: w must be bf16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kBlockN == 0 && k % 32 == 0, "pack_tiles: N must be a multiple of 16 and K of 32");
  return w.contiguous().view({n / kBlockN, kBlockN, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({n * k});
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tiled gemm: x must be bf16 [M, K]");
  TORCH_CHECK(packed.numel() == n * x.size(1) && n % kBlockN == 0 && x.size(1) % 32 == 0,
              "tiled gemm: packed weight mismatch");
}

// Any number of rows (the skinny and the vector paths are one kernel here), gated or not.
at::Tensor vec_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated) {
  check_packed(x, packed, n);
  TORCH_CHECK(!gated || n % (2 * kBlockN) == 0, "vec_gemm: gated needs gate and up of whole 16-output blocks");
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.contiguous(), bf = float_bias(bias, n);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const bf16* wp = rows_of(packed);
  at::parallel_for(0, gated ? n / kBlockN / 2 : n / kBlockN, 1, [&](int64_t b0, int64_t b1) {
    tile_gemm_range(rows_of(xc), m, k, wp, n, nullptr, bp, rows_of(y), gated, b0, b1);
  });
  return y;
}

at::Tensor tiled_skinny_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  return vec_gemm(x, packed, bias, n, false);
}

at::Tensor amx_gemm(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "amx_gemm: built without AMX");
}

bool amx_available() { return false; }

#endif  // TM_PORTABLE_BF16

#if defined(TM_PORTABLE_QUANT_GEMM)

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                      int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_gemm: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "quant_gemm: no rows");
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  const at::Tensor xc = x.contiguous(), bf = float_bias(bias, n);
  thread_local QuantRows buffers;  // a decode step makes ~120 of these calls: no allocation each time
  QuantRows* rows = &buffers;      // (inside the lambdas the thread_local's name would mean each worker's own)
  size_rows(buffers, m, k, group);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) quantize_row(*rows, rows_of(xc) + i * k, i, k, group);
  });
  auto y = at::empty({m, n}, x.options());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::parallel_for(0, n / kBlockN, 4, [&](int64_t b0, int64_t b1) {
    if (bits == 8) quant_gemm_range<8>(m, w, *rows, bp, rows_of(y), b0, b1);
    else quant_gemm_range<4>(m, w, *rows, bp, rows_of(y), b0, b1);
  });
  return y;
}

#endif  // TM_PORTABLE_QUANT_GEMM

#if defined(TM_PORTABLE_QUANT_TILES)

// Larger batches: each output block (gated: gate block and its up block) dequantized into a panel of the tile
// layout in the worker's buffer, then every row passes over it.
at::Tensor quant_vec_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_vec_gemm: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  TORCH_CHECK(!gated || n % (2 * kBlockN) == 0, "quant_vec_gemm: gated needs whole gate and up blocks");
  auto y = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.contiguous(), bf = float_bias(bias, n);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const int64_t nb = n / kBlockN, ldy = gated ? n / 2 : n;
  at::parallel_for(0, gated ? nb / 2 : nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<bf16> panels(2 * k * kBlockN);  // block b at 0 and, gated, its up block after it
    std::vector<bf16> out(m * kBlockN);
    for (int64_t b = b0; b < b1; ++b) {
      dequantize_panel(w, b, panels.data(), integers_of(w));
      if (gated) dequantize_panel(w, b + nb / 2, panels.data() + k * kBlockN, integers_of(w));
      // the panels as blocks 0 (and 1) of a 16- (or 32-) output weight, with their biases and (integers)
      // their scales
      const float* bias_b = nullptr;
      const float* scale_b = nullptr;
      float both[2 * kBlockN], scales[2 * kBlockN];
      if (bp) {
        std::memcpy(both, bp + b * kBlockN, sizeof(float) * kBlockN);
        if (gated) std::memcpy(both + kBlockN, bp + (b + nb / 2) * kBlockN, sizeof(float) * kBlockN);
        bias_b = both;
      }
      if (integers_of(w)) {
        store(scales, load_half(w.scale + b * kBlockN));
        store(scales + 8, load_half(w.scale + b * kBlockN + 8));
        if (gated) {
          store(scales + 16, load_half(w.scale + (b + nb / 2) * kBlockN));
          store(scales + 24, load_half(w.scale + (b + nb / 2) * kBlockN + 8));
        }
        scale_b = scales;
      }
      const int64_t width = gated ? 2 * kBlockN : kBlockN;
      tile_gemm_range(rows_of(xc), m, k, panels.data(), width, scale_b, bias_b, out.data(), gated, 0, 1);
      for (int64_t r = 0; r < m; ++r) std::memcpy(rows_of(y) + r * ldy + b * kBlockN, out.data() + r * kBlockN,
                                                   sizeof(bf16) * kBlockN);
    }
  });
  return y;
}

#endif  // TM_PORTABLE_QUANT_TILES

#if defined(TM_PORTABLE_DEQUANT)

// Output blocks [b0, b1) dequantized to w^T: [K, (b1 - b0) * 16] bf16, ready for x @ w^T.
at::Tensor quant_dequantize_t(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& min,
                              int64_t bits, int64_t group, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  TORCH_CHECK(0 <= b0 && b0 < b1 && b1 <= n / kBlockN, "quant_dequantize_t: block range out of bounds");
  const int64_t cols = (b1 - b0) * kBlockN;
  auto out = at::empty({k, cols}, at::TensorOptions().dtype(at::kBFloat16));
  at::parallel_for(b0, b1, 1, [&](int64_t c0, int64_t c1) {
    std::vector<bf16> panel(k * kBlockN);
    for (int64_t b = c0; b < c1; ++b) {
      dequantize_panel(w, b, panel.data());
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t o = 0; o < kBlockN; ++o)
          rows_of(out)[kk * cols + (b - b0) * kBlockN + o] = panel[(kk / 2) * 32 + o * 2 + kk % 2];
    }
  });
  return out;
}

#endif  // TM_PORTABLE_DEQUANT

}  // namespace

// What decoder_stack.cpp calls directly (native_ops.h), where this file's kernels are the build's.
namespace tokenmill_native {
#if defined(TM_PORTABLE_BF16)
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
at::Tensor tiled_skinny_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  return ::vec_gemm(x, packed, bias, n, false);
}
at::Tensor vec_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated) {
  return ::vec_gemm(x, packed, bias, n, gated);
}
// No prompt kernel in this build: the Python side sends the stack decode steps only (kernels.prefill_attention_op).
void prefill_attention(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, bool,
                       const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "prefill_attention: not built for this instruction set");
}
#endif
#if defined(TM_PORTABLE_QUANT_GEMM)
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                      int64_t group, int64_t n) {
  return ::quant_gemm(x, q, scale, min, bias, bits, group, n);
}
#endif
#if defined(TM_PORTABLE_QUANT_TILES)
at::Tensor quant_vec_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  return ::quant_vec_gemm(x, q, scale, min, bias, bits, group, n, gated);
}
#endif
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
#if defined(TM_PORTABLE_BF16)
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rope_and_cache(Tensor(a!) q_out, Tensor(b!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, int hq, int hkv, float k_scale=1.0, "
        "float v_scale=1.0, Tensor? k_offset=None) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("amx_available() -> bool");
  m.def("pack_tiles(Tensor w) -> Tensor");
  m.def("tiled_skinny_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("amx_gemm(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) -> Tensor");
  m.def("vec_gemm(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) -> Tensor");
#endif
#if defined(TM_PORTABLE_QUANT_GEMM)
  m.def("quant_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, "
        "int n) -> Tensor");
#endif
#if defined(TM_PORTABLE_QUANT_TILES)
  m.def("quant_vec_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, int n, "
        "bool gated=False) -> Tensor");
#endif
#if defined(TM_PORTABLE_DEQUANT)
  m.def("quant_dequantize_t(Tensor q, Tensor scale, Tensor? min, int bits, int group, int n, int k, int b0, "
        "int b1) -> Tensor");
#endif
}

#if defined(TM_PORTABLE_BF16)
TM_LIBRARY_IMPL(CatchAll, m) { m.impl("amx_available", &amx_available); }
#endif

TM_LIBRARY_IMPL(CPU, m) {
#if defined(TM_PORTABLE_BF16)
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("pack_tiles", &pack_tiles);
  m.impl("tiled_skinny_gemm", &tiled_skinny_gemm);
  m.impl("amx_gemm", &amx_gemm);
  m.impl("vec_gemm", &vec_gemm);
#endif
#if defined(TM_PORTABLE_QUANT_GEMM)
  m.impl("quant_gemm", &quant_gemm);
#endif
#if defined(TM_PORTABLE_QUANT_TILES)
  m.impl("quant_vec_gemm", &quant_vec_gemm);
#endif
#if defined(TM_PORTABLE_DEQUANT)
  m.impl("quant_dequantize_t", &quant_dequantize_t);
#endif
}

#endif  // TM_SIMD8
