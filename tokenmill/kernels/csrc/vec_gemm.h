// The matmul loop of amx_gemm.h on AVX-512 BF16 vectors, for CPUs without AMX: the same panels (the tile layout,
// packed at load or dequantized as the loop reaches them) and the same epilogues, so the bf16 and the quantized
// matmuls each have one path for batches past the skinny and VNNI kernels' few rows. Include inside an AVX-512
// BF16 guard, after amx_gemm.h.
//
// A panel's row for k pair p is 64 bytes, 16 outputs x 2 k, so one `vdpbf16ps` against a row of x's pair
// (broadcast) advances 16 outputs by two inputs. A register tile is kVecRows rows x a pair of blocks (24 fp32
// accumulators); the pair's panels (2 x K x 16 bf16) stay in L2 while every row tile of a pass of x (rows that
// fill a quarter of L2) goes over them, so a quantized weight is dequantized once per pass.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace tokenmill_tiles {

constexpr int kVecRows = 12;

// Rows of x per pass over the weights: about kChunkBytes of x (a quarter of L2), in passes of equal size.
inline int64_t vec_chunk(int64_t m, int64_t k) {
  const int64_t most = std::max<int64_t>(kVecRows, kChunkBytes / (k * 2));
  const int64_t passes = (m + most - 1) / most;
  return (m + passes - 1) / passes;
}

// Memory the next pair of panels will be made from (up to 4 regions: packed weights, scales), asked into L2
// a line per region per k step of a pair's first row tile, so that it is there when the pair's own k loop (or
// its dequantization) starts: without it each pair began with a wait on memory.
struct NextPanels {
  const char* base[4] = {};
  int64_t bytes[4] = {};
  int count = 0;
  void add(const void* p, int64_t n) {
    base[count] = static_cast<const char*>(p);
    bytes[count++] = n;
  }
};

// c[r][j] = x[r] . panel j over all K, rows [0, R) of x (row stride k); with next, the next panels' memory is
// asked for meanwhile.
template <int R>
inline void vec_tile(const uint16_t* x, int64_t k, const uint16_t* b0, const uint16_t* b1,
                     float c[kVecRows][2][kTileN], const NextPanels* next) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    if (next)
      for (int i = 0; i < next->count; ++i)
        if (p * 64 < next->bytes[i]) _mm_prefetch(next->base[i] + p * 64, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k + 2 * p));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(c[r][0], acc[r][0]);
    _mm512_store_ps(c[r][1], acc[r][1]);
  }
}

inline void vec_tile_rows(int rows, const uint16_t* x, int64_t k, const uint16_t* b0, const uint16_t* b1,
                          float c[kVecRows][2][kTileN], const NextPanels* next) {
  switch (rows) {
    case 1: vec_tile<1>(x, k, b0, b1, c, next); break;
    case 2: vec_tile<2>(x, k, b0, b1, c, next); break;
    case 3: vec_tile<3>(x, k, b0, b1, c, next); break;
    case 4: vec_tile<4>(x, k, b0, b1, c, next); break;
    case 5: vec_tile<5>(x, k, b0, b1, c, next); break;
    case 6: vec_tile<6>(x, k, b0, b1, c, next); break;
    case 7: vec_tile<7>(x, k, b0, b1, c, next); break;
    case 8: vec_tile<8>(x, k, b0, b1, c, next); break;
    case 9: vec_tile<9>(x, k, b0, b1, c, next); break;
    case 10: vec_tile<10>(x, k, b0, b1, c, next); break;
    case 11: vec_tile<11>(x, k, b0, b1, c, next); break;
    default: vec_tile<12>(x, k, b0, b1, c, next); break;
  }
}

// amx_gemm.h's gemm_range on vectors: output block pairs [p0, p1) (gated: gate block p with its up block) for
// the m rows of x (contiguous, not padded), in chunks of `chunk` rows.
template <class Panels>
void vec_gemm_range(const uint16_t* xp, int64_t m, int64_t k, Panels& panels, const float* bias, uint16_t* y,
                    int64_t n, bool gated, int64_t chunk, int64_t p0, int64_t p1) {
  alignas(64) float c[kVecRows][2][kTileN];
  alignas(64) float scale[2][kTileN];
  const int64_t blocks = n / kTileN, ldy = gated ? n / 2 : n;
  for (int64_t mc = 0; mc < m; mc += chunk) {
    const int64_t mc_end = std::min(m, mc + chunk);
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t nb = gated ? pi : 2 * pi, nb_second = gated ? pi + blocks / 2 : nb + 1;
      const bool pair = nb_second < blocks;
      const auto* w0 = reinterpret_cast<const uint16_t*>(panels.panel(nb, 0));
      // a lone last block is multiplied twice and written once
      const auto* w1 = pair ? reinterpret_cast<const uint16_t*>(panels.panel(nb_second, 1)) : w0;
      const bool scaled = panels.column_scale(nb, scale[0]);
      if (pair) panels.column_scale(nb_second, scale[1]);
      const float* s0 = scaled ? scale[0] : nullptr;
      const float* s1 = scaled ? scale[1] : nullptr;
      const float* bias0 = bias ? bias + nb * kTileN : nullptr;
      const float* bias1 = bias && pair ? bias + nb_second * kTileN : nullptr;
      // row tiles of equal size (16 rows: two of 8, not 12 and 4, whose weight loads would feed few products)
      const int64_t tiles = (mc_end - mc + kVecRows - 1) / kVecRows, per_tile = (mc_end - mc + tiles - 1) / tiles;
      NextPanels next;
      if (pi + 1 < p1) {
        const int64_t nb_next = gated ? pi + 1 : 2 * pi + 2, nb_next_second = gated ? pi + 1 + blocks / 2 : nb_next + 1;
        panels.next_bytes(nb_next, next);
        if (nb_next_second < blocks) panels.next_bytes(nb_next_second, next);
      }
      for (int64_t m0 = mc; m0 < mc_end; m0 += per_tile) {
        const int rows = static_cast<int>(std::min<int64_t>(per_tile, mc_end - m0));
        vec_tile_rows(rows, xp + m0 * k, k, w0, w1, c, m0 == mc && next.count ? &next : nullptr);
        for (int r = 0; r < rows; ++r) {
          uint16_t* out = y + (m0 + r) * ldy + nb * kTileN;
          if (gated) {
            store_gated_row(c[r][0], c[r][1], out, s0, s1, bias0, bias1);
            continue;
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                              (__m256i)_mm512_cvtneps_pbh(epilogue(c[r][0], s0, bias0)));
          if (pair)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (nb_second - nb) * kTileN),
                                (__m256i)_mm512_cvtneps_pbh(epilogue(c[r][1], s1, bias1)));
        }
      }
    }
  }
}

}  // namespace tokenmill_tiles
