// The AMX tile layout of a linear layer's weight and the AMX matmul loop over it, shared by the bf16 matmul
// (tiled_gemm.cpp, panels packed once at load) and the quantized one (quant_tiles.cpp, panels dequantized into
// a small buffer as the loop reaches them). Include inside an AVX-512 BF16 guard.
//
// Layout: for each block of 16 outputs, its K panel of 1 KB tiles (16 pairs of k x 16 outputs x 2),
// contiguous: [N / 16, K / 32, 16 (k pairs), 16 (outputs), 2 (k in pair)], the tile layout of w^T.
//
// Loop: C00 C01 C10 C11 (fp32, 16 x 16) accumulate a 32-row x 32-output block from A0 A1 (16 rows x 32 k)
// and B0 B1 (tiles of two panels); each weight tile is loaded once per chunk of rows of x held in L2. Gated,
// it pairs each gate block with its up block and writes silu(gate) * up from the accumulators, so an MLP's
// [M, 2I] product never goes through memory. Each block's results are written out a few rows per k step of
// the next block (PendingBlock), so the tile unit keeps working meanwhile.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace tokenmill_tiles {

constexpr int64_t kTileRows = 16;   // rows of an A or C tile; k pairs of a B tile
constexpr int64_t kTileK = 32;      // bf16 values of k per tile row (64 bytes)
constexpr int64_t kTileN = 16;      // outputs per B or C tile
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kChunkBytes = 512 * 1024;  // rows of x per pass over packed weights: a quarter of L2

// The fp32 value of an output: the accumulator times the column's scale (quantized weights kept as their
// integers), plus the bias (or zero: the bits of the unscaled path without a bias stay what they were).
inline __m512 epilogue(const float* c, const float* scale, const float* bias) {
  __m512 v = _mm512_loadu_ps(c);
  if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale));
  return _mm512_add_ps(v, bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
}

// silu(gate) * up of one row of a gate and an up C tile, into 16 bf16 outputs. gate and up are rounded to bf16
// first, as the unfused path (matmul, then silu_and_mul) rounds them, so both paths give the same bits.
inline void store_gated_row(const float* g, const float* u, uint16_t* y, const float* scale_g, const float* scale_u,
                            const float* bias_g, const float* bias_u) {
  const __m512 gv = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(epilogue(g, scale_g, bias_g)));
  const __m512 uv = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(epilogue(u, scale_u, bias_u)));
  const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(silu512(gv), uv));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)v);
}

}  // namespace tokenmill_tiles

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <ATen/ATen.h>

#include "amx.h"

namespace tokenmill_tiles {

// x [M, K] contiguous, its rows padded with zeros to a multiple of 32 so that every A tile load is whole.
inline at::Tensor padded_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), m_pad = (m + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  at::Tensor xc = x.contiguous();
  if (m_pad == m) return xc;
  at::Tensor padded = at::zeros({m_pad, x.size(1)}, x.options());
  padded.narrow(0, 0, m).copy_(xc);
  return padded;
}

// The stored C tiles of one 32-row x 32-output block, written out to y a few rows at a time while the next
// block's tile products run: written all at once, this epilogue filled the out-of-order window while the tile
// unit idled (spreading it took 8-25% off the matmuls of a 128-row decode step).
struct PendingBlock {
  alignas(64) float c[4][kTileRows * kTileN];  // C00 C01 C10 C11: [top / bottom half][first / second block]
  alignas(64) float scale[2][kTileN];          // the two blocks' column scales, where the panels have them
  uint16_t* y = nullptr;                       // row m0, column of the first block
  int64_t ldy = 0, col_second = 0, rows_top = 0, rows_bottom = 0;
  const float* bias_first = nullptr;
  const float* bias_second = nullptr;
  bool pair = false, gated = false, scaled = false;
  int64_t done = 0, total = 0;  // row writes: (top + bottom) x (gated or unpaired ? 1 : 2)

  // Row write i of this block: half, then block, then row (gated: one write makes 16 outputs of both blocks).
  void write(int64_t i) {
    const int64_t per_half_blocks = gated || !pair ? 1 : 2;
    const int64_t half = i / (kTileRows * per_half_blocks) ? 1 : 0;
    const int64_t rest = i - half * kTileRows * per_half_blocks;
    const int64_t j = rest / kTileRows, row = rest % kTileRows;
    if (row >= (half ? rows_bottom : rows_top)) return;
    uint16_t* out = y + (half * kTileRows + row) * ldy;
    const float* s0 = scaled ? scale[0] : nullptr;
    const float* s1 = scaled ? scale[1] : nullptr;
    if (gated) {
      store_gated_row(c[2 * half] + row * kTileN, c[2 * half + 1] + row * kTileN, out, s0, s1, bias_first,
                      bias_second);
      return;
    }
    const __m512 v = epilogue(c[2 * half + j] + row * kTileN, j ? s1 : s0, j ? bias_second : bias_first);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (j ? col_second : 0)), (__m256i)_mm512_cvtneps_pbh(v));
  }
  void write_some(int64_t count) {
    for (const int64_t end = std::min(total, done + count); done < end; ++done) write(done);
  }
};

// Output block pairs [p0, p1) for all rows of x (padded to a multiple of 32 rows). A pair is blocks (2p, 2p+1)
// (the second absent past the last block), or, when gated, gate block p and its up block p + n/32, whose
// product silu(gate) * up is the output. Rows go in chunks of `chunk` rows that stay in L2 while the thread's
// weight range passes them once per chunk.
// Panels: `const char* panel(int64_t nb, int slot)`, block nb's K panel in the tile layout (slot 0 or 1: the
// pair's first or second block; valid until that slot's next call), and `bool column_scale(int64_t nb,
// float* out)`, which writes block nb's 16 output scales and answers true where the panel holds unscaled values.
template <class Panels>
void gemm_range(const uint16_t* xp, int64_t m, int64_t m_pad, int64_t k, Panels& panels, const float* bias,
                uint16_t* y, int64_t n, bool gated, int64_t chunk, int64_t p0, int64_t p1) {
  tokenmill_amx::configure_tiles();
  PendingBlock out;  // the previous block's results, written out during this block's k steps
  bool pending = false;
  const int64_t kb = k / kTileK, lda = k * 2, blocks = n / kTileN;
  const int64_t ldy = gated ? n / 2 : n;
  for (int64_t mc = 0; mc < m_pad; mc += chunk) {
    const int64_t mc_end = std::min(m_pad, mc + chunk);
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t nb = gated ? pi : 2 * pi, nb_second = gated ? pi + blocks / 2 : nb + 1;
      const bool pair = nb_second < blocks;
      const char* b0 = panels.panel(nb, 0);
      const char* b1 = pair ? panels.panel(nb_second, 1) : nullptr;
      for (int64_t m0 = mc; m0 < mc_end; m0 += 2 * kTileRows) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const char* a = reinterpret_cast<const char*>(xp + m0 * k);
        const int64_t per_step = pending ? (out.total - out.done + kb - 1) / kb : 0;
        for (int64_t cb = 0; cb < kb; ++cb) {
          TILE_LOAD(4, a + cb * 64, lda);
          TILE_LOAD(5, a + kTileRows * lda + cb * 64, lda);
          TILE_LOAD(6, b0 + cb * kTileBytes, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (pair) {
            TILE_LOAD(7, b1 + cb * kTileBytes, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
          if (pending) out.write_some(per_step);
        }
        if (pending) out.write_some(out.total);
        _tile_stored(0, out.c[0], 64);
        _tile_stored(2, out.c[2], 64);
        if (pair) {
          _tile_stored(1, out.c[1], 64);
          _tile_stored(3, out.c[3], 64);
        }
        const int64_t col = nb * kTileN;
        out.scaled = panels.column_scale(nb, out.scale[0]);
        if (pair) panels.column_scale(nb_second, out.scale[1]);
        out.y = y + m0 * ldy + col;
        out.ldy = ldy;
        out.col_second = (nb_second - nb) * kTileN;
        out.rows_top = std::clamp<int64_t>(m - m0, 0, kTileRows);
        out.rows_bottom = std::clamp<int64_t>(m - m0 - kTileRows, 0, kTileRows);
        out.bias_first = bias ? bias + col : nullptr;
        out.bias_second = bias && pair ? bias + nb_second * kTileN : nullptr;
        out.pair = pair;
        out.gated = gated;
        out.done = 0;
        out.total = 2 * kTileRows * (gated || !pair ? 1 : 2);
        pending = true;
      }
    }
  }
  if (pending) out.write_some(out.total);
  _tile_release();
}

}  // namespace tokenmill_tiles

#endif
