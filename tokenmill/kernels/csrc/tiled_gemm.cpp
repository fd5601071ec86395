// bf16 linear layers over one weight layout, the AMX tile layout: y[M, N] = x[M, K] @ w[N, K]^T + b.
//
// Each weight is repacked once into the tile layout of amx_gemm.h: for each block of 16 outputs, its K panel of
// 1 KB tiles (16 pairs of k x 16 outputs x 2), contiguous. Three kernels read it, each as one sequential weight
// stream per thread:
//  - skinny (1-8 rows with AMX, 1-4 without; AVX-512 BF16): a panel row (64 bytes) is 16 outputs x one pair of
//    k, so a `vdpbf16ps` against the broadcast input pair advances 16 outputs at once with no horizontal sums. A
//    decode step of a small batch is a pure weight stream; oneDNN's blocked kernels stream SmolLM2's small
//    weights at ~14 GB/s here, this one at ~20 GB/s, what the machine reads. Each row's sums are the same
//    whatever the rows beside it, so a token gets the same bits in any batch: drafts verified together (up to 7
//    and the bonus) give what decoding them one at a time gives, and bf16 speculation stays lossless.
//  - AMX (9 to a few hundred rows; the loop is amx_gemm.h's, shared with the quantized AMX matmul): C00 C01 C10
//    C11 (fp32, 16 x 16) accumulate a 32-row x 32-output block from A0 A1 (16 rows x 32 k) and B0 B1 (tiles of
//    the panels); each weight tile is loaded once per chunk of x held in L2. At 8-64 rows it is 10-40% faster
//    than oneDNN's packed matmul here (the weights are a stream from memory at these sizes); beyond ~128 rows
//    oneDNN's tuned kernels win. Gated, it writes silu(gate) * up from the accumulators, so an MLP's [M, 2I]
//    product never goes through memory (0.87 -> 0.57 ms a layer at 128 rows, weights cold); each block's
//    results are written out during the next block's k steps (gated MLP at 128 rows 0.46 -> 0.43 ms).
//  - vectors (every batch past the skinny kernel's, on CPUs without AMX; vec_gemm.h): the AMX loop's panels and
//    epilogues, with 12-row x 32-output register tiles of `vdpbf16ps`. Like the skinny kernel, each row's sums
//    do not depend on the rows beside it, and it gives the skinny kernel's bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_gemm.h"
#include "vec_gemm.h"

namespace {

using namespace tokenmill_tiles;

// w [N, K] -> [N / 16, K / 32, 16 (k pairs), 16 (outputs), 2 (k in pair)]: the tile layout of w^T.
at::Tensor pack_tiles(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_tiles: w must be bf16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kTileN == 0 && k % kTileK == 0, "pack_tiles: N must be a multiple of 16 and K of 32");
  auto wc = w.contiguous();
  auto packed = at::empty({n * k}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t kb = k / kTileK;
  at::parallel_for(0, n / kTileN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t c = 0; c < kb; ++c) {
        uint16_t* tile = dst + (nb * kb + c) * (kTileBytes / 2);
        for (int64_t p = 0; p < kTileRows; ++p)
          for (int64_t o = 0; o < kTileN; ++o)
            for (int64_t e = 0; e < 2; ++e)
              tile[(p * kTileN + o) * 2 + e] = src[(nb * kTileN + o) * k + c * kTileK + 2 * p + e];
      }
  });
  return packed;
}

// Rows [0, M) x output blocks [nb0, nb1), J blocks at a time: J x M independent accumulator chains.
template <int M, int J>
void skinny_blocks(const uint32_t* x, int64_t k, const uint16_t* wp, const float* bias, uint16_t* y, int64_t n,
                   int64_t nb0, int64_t nb1) {
  const int64_t pairs = k / 2, panel = pairs * 32;  // panel: bf16 values per 16-output block
  for (int64_t nb = nb0; nb + J <= nb1; nb += J) {
    __m512 acc[J][M];
    for (int j = 0; j < J; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
    const uint16_t* b = wp + nb * panel;
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh xb[M];
      for (int m = 0; m < M; ++m) xb[m] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[m * pairs + p]));
      for (int j = 0; j < J; ++j) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(b + j * panel + p * 32);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv, xb[m]);
      }
    }
    for (int j = 0; j < J; ++j) {
      const __m512 bv = bias ? _mm512_loadu_ps(bias + (nb + j) * 16) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[j][m], bv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n + (nb + j) * 16), (__m256i)v);
      }
    }
  }
}

template <int M>
void skinny_range(const uint32_t* x, int64_t k, const uint16_t* wp, const float* bias, uint16_t* y, int64_t n,
                  int64_t nb0, int64_t nb1) {
  constexpr int J = M <= 4 ? 4 : 2;  // J x M accumulators and M broadcasts within the 32 vector registers
  const int64_t whole = nb0 + (nb1 - nb0) / J * J;
  skinny_blocks<M, J>(x, k, wp, bias, y, n, nb0, whole);
  skinny_blocks<M, 1>(x, k, wp, bias, y, n, whole, nb1);
}

// bias as fp32 (or undefined), checked against N
at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "tiled gemm: bias must be [N]");
  return bias->to(at::kFloat).contiguous();
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tiled gemm: x must be bf16 [M, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.numel() == n * k && n % kTileN == 0 && k % kTileK == 0, "tiled gemm: packed weight mismatch");
}

at::Tensor tiled_skinny_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  check_packed(x, packed, n);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= 8, "tiled_skinny_gemm: 1 to 8 rows");
  auto xc = x.contiguous();
  auto y = at::empty({m, n}, x.options());
  const at::Tensor bf = float_bias(bias, n);
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / kTileN, 4, [&](int64_t b0, int64_t b1) {
    switch (m) {
      case 1: skinny_range<1>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 2: skinny_range<2>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 3: skinny_range<3>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 4: skinny_range<4>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 5: skinny_range<5>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 6: skinny_range<6>(xp, k, wp, bp, yp, n, b0, b1); break;
      case 7: skinny_range<7>(xp, k, wp, bp, yp, n, b0, b1); break;
      default: skinny_range<8>(xp, k, wp, bp, yp, n, b0, b1); break;
    }
  });
  return y;
}

// The panels as packed at load: a pointer into the packed weight, no column scales.
struct PackedPanels {
  const char* base;
  int64_t panel_bytes;
  const char* panel(int64_t nb, int) const { return base + nb * panel_bytes; }
  bool column_scale(int64_t, float*) const { return false; }
  void next_bytes(int64_t nb, NextPanels& next) const { next.add(panel(nb, 0), panel_bytes); }
};

// Either tile matmul: the arguments checked, the output made, and each thread's block pairs [p0, p1) handed to
// `loop(panels, x, m, m_x, k, bias, y, p0, p1)`. x goes as `prepare` returns it (AMX pads its rows to whole
// tiles: m_x is that tensor's row count, m the real one).
template <class Prepare, class Loop>
at::Tensor tile_gemm(const char* name, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, int64_t n, bool gated, Prepare prepare, Loop loop) {
  check_packed(x, packed, n);
  TORCH_CHECK(!gated || n % (2 * kTileN) == 0, name, ": gated needs gate and up of whole 16-output blocks");
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = prepare(x);
  const at::Tensor bf = float_bias(bias, n);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t pairs = gated ? n / kTileN / 2 : (n / kTileN + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    PackedPanels panels{reinterpret_cast<const char*>(packed.data_ptr()), k / kTileK * kTileBytes};
    loop(panels, xp, m, xc.size(0), k, bp, yp, p0, p1);
  });
  return y;
}

// amx_gemm on AVX-512 BF16 vectors (vec_gemm.h), for CPUs without AMX.
at::Tensor vec_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                    int64_t n, bool gated) {
  return tile_gemm("vec_gemm", x, packed, bias, n, gated, [](const at::Tensor& t) { return t.contiguous(); },
                   [&](PackedPanels& panels, const uint16_t* xp, int64_t m, int64_t, int64_t k, const float* bp,
                       uint16_t* yp, int64_t p0, int64_t p1) {
                     tokenmill_tiles::vec_gemm_range(xp, m, k, panels, bp, yp, n, gated, vec_chunk(m, k), p0, p1);
                   });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// y = x @ w^T + b, or with gated: y = silu(gate) * up where w stacks gate over up ([2I, K] -> y [M, I]).
at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                    int64_t n, bool gated) {
  TORCH_CHECK(tokenmill_amx::permitted(), "amx_gemm: this CPU or kernel does not allow AMX");
  const int64_t lda = x.size(-1) * 2;
  const int64_t chunk = std::max<int64_t>(2 * kTileRows, kChunkBytes / lda / (2 * kTileRows) * (2 * kTileRows));
  return tile_gemm("amx_gemm", x, packed, bias, n, gated, [](const at::Tensor& t) { return padded_rows(t); },
                   [&](PackedPanels& panels, const uint16_t* xp, int64_t m, int64_t m_pad, int64_t k,
                       const float* bp, uint16_t* yp, int64_t p0, int64_t p1) {
                     tokenmill_tiles::gemm_range(xp, m, m_pad, k, panels, bp, yp, n, gated, chunk, p0, p1);
                   });
}

bool amx_available() { return tokenmill_amx::permitted(); }
#else
bool amx_available() { return false; }
at::Tensor amx_gemm(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "amx_gemm: built without AMX");
  return at::Tensor();
}
#endif

}  // namespace

namespace tokenmill_native {
at::Tensor tiled_skinny_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  return ::tiled_skinny_gemm(x, packed, bias, n);
}
at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated) {
  return ::amx_gemm(x, packed, bias, n, gated);
}
at::Tensor vec_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated) {
  return ::vec_gemm(x, packed, bias, n, gated);
}
bool amx_permitted() { return ::amx_available(); }
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("amx_available() -> bool");
  m.def("pack_tiles(Tensor w) -> Tensor");
  m.def("tiled_skinny_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("amx_gemm(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) -> Tensor");
  m.def("vec_gemm(Tensor x, Tensor packed, Tensor? bias, int n, bool gated=False) -> Tensor");
}
TM_LIBRARY_IMPL(CatchAll, m) { m.impl("amx_available", &amx_available); }
TM_LIBRARY_IMPL(CPU, m) {
  m.impl("pack_tiles", &pack_tiles);
  m.impl("tiled_skinny_gemm", &tiled_skinny_gemm);
  m.impl("amx_gemm", &amx_gemm);
  m.impl("vec_gemm", &vec_gemm);
}

#endif
