// Quantized linear layers for batches past a few dozen rows: y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b, with w
// in the packed layout of quant_layout.h, multiplied by the bf16 tile matmul: AMX's loop (amx_gemm.h) where the
// CPU has AMX, the vectors' (vec_gemm.h) elsewhere.
//
// The VNNI kernel (quant_gemm.cpp) reads the packed bytes once per call, but its byte dot products run on the
// vector units: at 32 rows it took 1.6x the bf16 AMX matmul's time and at 128-256 rows 2.2-4x, so a batched
// decode step with int8 weights was slower than bf16 (W1); without AMX, 1.2x (int8) and 1.5x (int4) the bf16
// vector matmul's at 128 rows. Here each thread dequantizes a pair of 16-output panels at a time into the tile
// layout (a buffer of 2 x K x 16 bf16 that stays in L1/L2) and the bf16 loop multiplies every row of x by it;
// the packed bytes are still read once per call.
//  - int8 with one scale per output (bits 8, one group): the panel holds the integers q themselves (exact in
//    bf16), and the epilogue multiplies each output's fp32 sum by its scale: no rounding of the weights.
//  - groups (int4, GGUF blocks): the panel holds bf16(scale * q + min), what the dequantized reference path
//    multiplies.
// Gated (an MLP's gate over up), the epilogue writes silu(gate) * up as the bf16 matmul does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "amx_gemm.h"
#include "quant_layout.h"
#include "vec_gemm.h"

namespace {

using namespace tokenmill_tiles;
using namespace tokenmill_quant;

// One k-pair row of a tile, [16 outputs][2] bf16, from the 16 outputs' values at the even and the odd k.
inline __m512i pair_row(__m512 even, __m512 odd) {
  // cvtne2ps_pbh(a, b) puts b's 16 values first, then a's; the permutation interleaves them per output
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}

// Block nb's K panel in the tile layout (16 x K bf16): w = scale * q + min per group, rounded to nearest even
// as the dequantized path rounds it, or with `integers` (8 bits, one group) q itself.
void dequantize_panel(const QuantView& w, int64_t nb, bool integers, uint16_t* out) {
  const int64_t ng = w.groups();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t at = (nb * ng + g) * kBlockN;
    // 8-bit values are stored as q + 128: w = s * stored - 128 s
    const __m512 s = integers ? _mm512_set1_ps(1.0f) : load_half16(w.scale + at);
    const __m512 mn = w.bits == 4 ? load_half16(w.min + at) : _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
    for (int64_t kk = g * w.group; kk < (g + 1) * w.group; kk += 8) {
      __m512 v[8];
      dequantize8(w, nb, kk, s, mn, v);
      // tiles are consecutive in k: k pair p is row p % 16 of tile p / 16
      for (int e = 0; e < 8; e += 2) _mm512_storeu_si512(out + (kk + e) / 2 * 32, pair_row(v[e], v[e + 1]));
    }
  }
}

// The panels of amx_gemm.h's loop, dequantized as the loop reaches them into the thread's two slots.
struct QuantPanels {
  const QuantView& w;
  bool integers;
  uint16_t* slot[2];

  const char* panel(int64_t nb, int s) {
    dequantize_panel(w, nb, integers, slot[s]);
    return reinterpret_cast<const char*>(slot[s]);
  }
  void next_bytes(int64_t nb, NextPanels& next) const {  // the packed bytes and the scales (minima: few)
    next.add(w.q + nb * w.block_bytes(), w.block_bytes());
    if (next.count < 4) next.add(w.scale + nb * w.groups() * kBlockN, w.groups() * kBlockN * 2);
  }
  bool column_scale(int64_t nb, float* out) const {
    if (!integers) return false;
    _mm512_storeu_ps(out, load_half16(w.scale + nb * kBlockN));  // one group: a scale per output
    return true;
  }
};

// Either matmul: the arguments checked, the output made, and each thread's block pairs [p0, p1) handed to
// `loop(panels, x, m, m_x, k, bias, y, p0, p1)` with its own two panel slots (64-byte aligned). x goes as
// `prepare` returns it (AMX pads its rows to whole tiles: m_x is that tensor's row count, m the real one).
template <class Prepare, class Loop>
at::Tensor quant_tile_gemm(const char* name, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                           int64_t group, int64_t n, bool gated, Prepare prepare, Loop loop) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const QuantView w = view_of(q, scale, min, bits, group, n, k);
  TORCH_CHECK(!gated || n % (2 * kTileN) == 0, name, ": gated needs gate and up of whole 16-output blocks");
  auto y = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = prepare(x);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, name, ": bias must be [N]");
    bf = bias->to(at::kFloat).contiguous();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const bool integers = bits == 8 && group == k;
  const int64_t pairs = gated ? n / kTileN / 2 : (n / kTileN + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint16_t> buffer;  // this worker's own: two panels, 64-byte aligned
    buffer.resize(2 * k * kTileN + 32);
    auto* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    QuantPanels panels{w, integers, {base, base + k * kTileN}};
    loop(panels, xp, m, xc.size(0), k, bp, yp, p0, p1);
  });
  return y;
}

// On AVX-512 BF16 vectors (vec_gemm.h), for CPUs without AMX. Each panel is dequantized once per pass of rows
// (one pass up to ~450-900 rows; a 2,048-row prompt chunk of int8 took 1.6% longer in one pass).
at::Tensor quant_vec_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  return quant_tile_gemm("quant_vec_gemm", x, q, scale, min, bias, bits, group, n, gated,
                         [](const at::Tensor& t) { return t.contiguous(); },
                         [&](QuantPanels& panels, const uint16_t* xp, int64_t m, int64_t, int64_t k, const float* bp,
                             uint16_t* yp, int64_t p0, int64_t p1) {
                           tokenmill_tiles::vec_gemm_range(xp, m, k, panels, bp, yp, n, gated, vec_chunk(m, k), p0, p1);
                         });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// On AMX tiles (amx_gemm.h), every row in one pass: a panel is dequantized once per call.
at::Tensor quant_amx_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  TORCH_CHECK(tokenmill_amx::permitted(), "quant_amx_gemm: this CPU or kernel does not allow AMX");
  return quant_tile_gemm("quant_amx_gemm", x, q, scale, min, bias, bits, group, n, gated,
                         [](const at::Tensor& t) { return padded_rows(t); },
                         [&](QuantPanels& panels, const uint16_t* xp, int64_t m, int64_t m_pad, int64_t k,
                             const float* bp, uint16_t* yp, int64_t p0, int64_t p1) {
                           tokenmill_tiles::gemm_range(xp, m, m_pad, k, panels, bp, yp, n, gated, m_pad, p0, p1);
                         });
}

#endif

}  // namespace

namespace tokenmill_native {
at::Tensor quant_vec_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  return ::quant_vec_gemm(x, q, scale, min, bias, bits, group, n, gated);
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
at::Tensor quant_amx_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated) {
  return ::quant_amx_gemm(x, q, scale, min, bias, bits, group, n, gated);
}
#endif
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("quant_vec_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, int n, "
        "bool gated=False) -> Tensor");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("quant_amx_gemm(Tensor x, Tensor q, Tensor scale, Tensor? min, Tensor? bias, int bits, int group, int n, "
        "bool gated=False) -> Tensor");
#endif
}
TM_LIBRARY_IMPL(CPU, m) {
  m.impl("quant_vec_gemm", &quant_vec_gemm);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.impl("quant_amx_gemm", &quant_amx_gemm);
#endif
}

#endif
