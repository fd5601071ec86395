// The decode hot path for CPUs without AVX-512 (AVX2 laptops and servers, ARM NEON), written once against
// simd8.h: fused norms, silu-and-mul, rope, greedy argmax, the bf16 matmul over the tile layout (tiled_gemm.cpp's
// pack_tiles) and the quantized matmul over the byte layout of quant_layout.h, both storing bf16 and computing
// in fp32. Pointer-level and torch-free: portable_ops.cpp wraps them as ops, tests/native/portable_harness.cpp
// runs them standalone (the NEON build under qemu).
//
// Where the AVX-512 kernels define the bits, these give the same ones: the matmuls sum each output in the same
// order with the same roundings (the quantized one in exact integer sums), and the norm reduces its 16 partial
// sums in the order of _mm512_reduce_add_ps. silu uses a division where AVX-512 has a reciprocal estimate, so
// it agrees within a few ulps only.
#pragma once

#include "quant_view.h"
#include "simd8.h"

#if defined(TM_SIMD8)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace tm_portable {

using namespace tm_simd;

using tokenmill_quant::kBlockN;  // outputs per block of both weight layouts
using tokenmill_quant::QuantView;

inline float bf16_to_float(bf16 h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<bf16>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// 16 bf16 values at p, zero past `count` (< 16: a row's tail), as two 8-lane halves
inline void load16(const bf16* p, int64_t count, F8& lo, F8& hi) {
  if (count >= 16) {
    lo = load_bf16(p);
    hi = load_bf16(p + 8);
    return;
  }
  bf16 buf[16] = {};
  std::memcpy(buf, p, count * sizeof(bf16));
  lo = load_bf16(buf);
  hi = load_bf16(buf + 8);
}
inline void store16(bf16* p, int64_t count, F8 lo, F8 hi) {
  if (count >= 16) {
    store_bf16(p, lo);
    store_bf16(p + 8, hi);
    return;
  }
  bf16 buf[16];
  store_bf16(buf, lo);
  store_bf16(buf + 8, hi);
  std::memcpy(p, buf, count * sizeof(bf16));
}
inline void load16f(const float* p, int64_t count, F8& lo, F8& hi) {
  if (count >= 16) {
    lo = load(p);
    hi = load(p + 8);
    return;
  }
  float buf[16] = {};
  std::memcpy(buf, p, count * sizeof(float));
  lo = load(buf);
  hi = load(buf + 8);
}
// The sum of 16 lanes (lo: 0..7, hi: 8..15) in _mm512_reduce_add_ps's order.
inline float reduce16(F8 lo, F8 hi) {
  float s[8];
  store(s, add(hi, lo));
  const float t0 = s[4] + s[0], t1 = s[5] + s[1], t2 = s[6] + s[2], t3 = s[7] + s[3];
  return (t0 + t2) + (t1 + t3);
}

// rms_norm of one row (after residual += x, stored back rounded to bf16, where a residual is given):
// out = x * rsqrt(mean(x^2) + eps) * w.
inline void norm_row(bf16* out, const bf16* x, bf16* residual, const bf16* w, int64_t d, float eps) {
  F8 ss_lo = zero(), ss_hi = zero();
  for (int64_t j = 0; j < d; j += 16) {
    F8 lo, hi;
    load16(x + j, d - j, lo, hi);
    if (residual) {
      F8 rlo, rhi;
      load16(residual + j, d - j, rlo, rhi);
      float buf[16];
      store(buf, add(lo, rlo));
      store(buf + 8, add(hi, rhi));
      for (float& v : buf) v = round_bf16(v);
      lo = load(buf);
      hi = load(buf + 8);
      store16(residual + j, d - j, lo, hi);
    }
    ss_lo = fma(lo, lo, ss_lo);
    ss_hi = fma(hi, hi, ss_hi);
  }
  const F8 r = set1(1.0f / std::sqrt(reduce16(ss_lo, ss_hi) / static_cast<float>(d) + eps));
  const bf16* src = residual ? residual : x;
  for (int64_t j = 0; j < d; j += 16) {
    F8 lo, hi, wlo, whi;
    load16(src + j, d - j, lo, hi);
    load16(w + j, d - j, wlo, whi);
    store16(out + j, d - j, mul(mul(lo, r), wlo), mul(mul(hi, r), whi));
  }
}

// e^x on 8 lanes: 2^t = 2^floor(t) poly(frac(t)), vec_math.h's polynomial; ~1e-7 relative.
inline F8 exp8(F8 x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const F8 t = mul(x, set1(1.44269504088896341f));
  const F8 fi = floor(t);
  const F8 f = sub(t, fi);
  F8 p = set1(1.535336188319500e-4f);
  p = fma(p, f, set1(1.339887440266574e-3f));
  p = fma(p, f, set1(9.618437357674640e-3f));
  p = fma(p, f, set1(5.550332471162809e-2f));
  p = fma(p, f, set1(2.402264791363012e-1f));
  p = fma(p, f, set1(6.931472028550421e-1f));
  p = fma(p, f, set1(1.0f));
  return mul(p, exp2_int(fi));
}
inline F8 silu8(F8 x) { return div(x, add(set1(1.0f), exp8(sub(zero(), x)))); }

// out[j] = silu(gate[j]) * up[j] for one row
inline void silu_mul_row(bf16* out, const bf16* gate, const bf16* up, int64_t d) {
  for (int64_t j = 0; j < d; j += 16) {
    F8 g0, g1, u0, u1;
    load16(gate + j, d - j, g0, g1);
    load16(up + j, d - j, u0, u1);
    store16(out + j, d - j, mul(silu8(g0), u0), mul(silu8(g1), u1));
  }
}

// rotate-half rope on one head (out may be x): out[j] = x[j] cos[j] - x[j+h] sin[j],
// out[j+h] = x[j+h] cos[j+h] + x[j] sin[j+h].
inline void rope_head(bf16* out, const bf16* x, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; j += 16) {
    const int64_t c = h - j;
    F8 a0, a1, b0, b1, c0, c1, s0, s1, ch0, ch1, sh0, sh1;
    load16(x + j, c, a0, a1);
    load16(x + h + j, c, b0, b1);
    load16f(cos + j, c, c0, c1);
    load16f(sin + j, c, s0, s1);
    load16f(cos + h + j, c, ch0, ch1);
    load16f(sin + h + j, c, sh0, sh1);
    const F8 lo0 = fnma(b0, s0, mul(a0, c0)), lo1 = fnma(b1, s1, mul(a1, c1));
    const F8 hi0 = fma(a0, sh0, mul(b0, ch0)), hi1 = fma(a1, sh1, mul(b1, ch1));
    store16(out + j, c, lo0, lo1);
    store16(out + h + j, c, hi0, hi1);
  }
}

// The index of the row's largest value, the first on ties (NaN never wins).
inline int64_t argmax_row(const bf16* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  for (int64_t j = 0; j < v; ++j) {
    const float x = bf16_to_float(row[j]);
    if (x > best) {
      best = x;
      at = j;
    }
  }
  return at;
}

// ---- bf16 matmul over the tile layout: per block of 16 outputs, K/2 rows of 16 (k, k+1) pairs (64 bytes) ----

// Rows [0, m) of x (bf16, row stride ldx) against one block's panel: acc[r][0..1] = 16 fp32 sums of row r.
// Each output is one chain in k order, the pair's second product first (vdpbf16ps's order), so a row's sums
// equal the AVX-512 kernels' and do not depend on the rows beside it.
template <int M>
inline void panel_rows(const bf16* x, int64_t ldx, int64_t k, const bf16* panel, F8 (*acc)[2]) {
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t p = 0; p < k / 2; ++p) {
    const bf16* at = panel + p * 32;
    prefetch(at + 512);
    F8 w0a, w0b, w1a, w1b;  // outputs 0..7 and 8..15: first and second of the pair
    load_bf16_pairs(at, w0a, w0b);
    load_bf16_pairs(at + 16, w1a, w1b);
    for (int r = 0; r < M; ++r) {
      const F8 xa = set1(bf16_to_float(x[r * ldx + 2 * p])), xb = set1(bf16_to_float(x[r * ldx + 2 * p + 1]));
      acc[r][0] = fma(w0a, xa, fma(w0b, xb, acc[r][0]));
      acc[r][1] = fma(w1a, xa, fma(w1b, xb, acc[r][1]));
    }
  }
}

// The fp32 value of 16 outputs: the sums times the columns' scales (quantized weights kept as their integers;
// 16 floats or null), plus the bias (16 floats, or zero), as amx_gemm.h's epilogue.
inline void epilogue(const F8* acc, const float* scale, const float* bias, F8& lo, F8& hi) {
  lo = acc[0];
  hi = acc[1];
  if (scale) {
    lo = mul(lo, load(scale));
    hi = mul(hi, load(scale + 8));
  }
  lo = add(lo, bias ? load(bias) : zero());
  hi = add(hi, bias ? load(bias + 8) : zero());
}

// y[r, 16 b .. 16 b + 15] (row stride ldy) for rows [0, m) of one block
template <int M>
inline void store_block(const F8 (*acc)[2], const float* scale, const float* bias, bf16* y, int64_t ldy) {
  for (int r = 0; r < M; ++r) {
    F8 lo, hi;
    epilogue(acc[r], scale, bias, lo, hi);
    store_bf16(y + r * ldy, lo);
    store_bf16(y + r * ldy + 8, hi);
  }
}

// silu(gate) * up of 16 outputs of one row: each rounded to bf16 first, as the unfused matmul then
// silu_mul_row see them, so the fused and unfused paths give the same bits.
inline void store_gated(const F8* g, const F8* u, const float* sg, const float* su, const float* bg,
                        const float* bu, bf16* y) {
  bf16 gb[16], ub[16];
  F8 g0, g1, u0, u1;
  epilogue(g, sg, bg, g0, g1);
  epilogue(u, su, bu, u0, u1);
  store_bf16(gb, g0);
  store_bf16(gb + 8, g1);
  store_bf16(ub, u0);
  store_bf16(ub + 8, u1);
  silu_mul_row(y, gb, ub, 16);
}

// One tile of up to 4 rows: plain (block b into y's columns 16 b..) or gated (gate block b, up block b + nb / 2,
// into columns 16 b.. of the [m, n / 2] output).
// scale, bias: per output (n floats) or null.
template <int M>
inline void tile_rows(const bf16* x, int64_t ldx, int64_t k, const bf16* panels, int64_t panel_len, int64_t nb,
                      const float* scale, const float* bias, bf16* y, int64_t ldy, int64_t b, bool gated) {
  auto at = [](const float* p, int64_t block) { return p ? p + block * kBlockN : nullptr; };
  F8 acc[M][2];
  panel_rows<M>(x, ldx, k, panels + b * panel_len, acc);
  if (!gated) {
    store_block<M>(acc, at(scale, b), at(bias, b), y + b * kBlockN, ldy);
    return;
  }
  F8 up[M][2];
  const int64_t ub = b + nb / 2;
  panel_rows<M>(x, ldx, k, panels + ub * panel_len, up);
  for (int r = 0; r < M; ++r)
    store_gated(acc[r], up[r], at(scale, b), at(scale, ub), at(bias, b), at(bias, ub), y + r * ldy + b * kBlockN);
}

// Rows [0, m) x output blocks [b0, b1) (gated: gate blocks, each with its up block). A block's panel (K x 32
// bytes) stays in L1 while every 4-row tile of x passes over it: one weight stream per call.
inline void tile_gemm_range(const bf16* x, int64_t m, int64_t k, const bf16* panels, int64_t n, const float* scale,
                            const float* bias, bf16* y, bool gated, int64_t b0, int64_t b1) {
  const int64_t panel_len = k * kBlockN, nb = n / kBlockN, ldy = gated ? n / 2 : n;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < m; r += 4) {
      const bf16* xr = x + r * k;
      bf16* yr = y + r * ldy;
      switch (std::min<int64_t>(4, m - r)) {
        case 1: tile_rows<1>(xr, k, k, panels, panel_len, nb, scale, bias, yr, ldy, b, gated); break;
        case 2: tile_rows<2>(xr, k, k, panels, panel_len, nb, scale, bias, yr, ldy, b, gated); break;
        case 3: tile_rows<3>(xr, k, k, panels, panel_len, nb, scale, bias, yr, ldy, b, gated); break;
        default: tile_rows<4>(xr, k, k, panels, panel_len, nb, scale, bias, yr, ldy, b, gated); break;
      }
    }
}

// ---- quantized matmul over the byte layout (quant_layout.h): 8-bit q + 128, or 4-bit nibbles; fp16 groups ----

// Rows of x as integers, per block of 32 inputs (quant_gemm.cpp's QuantRows, computed the same way): x ~ d (hi +
// lo / 256), hi = round(x / d), d = amax / 127, lo the rounded remainder in 1/256ths.
struct QuantRows {
  std::vector<int8_t> hi, lo;  // [M, K]
  std::vector<float> scale;    // [M, K/32]: d / 256
  std::vector<int32_t> qsum;   // [M, K/32]: sum of 256 hi + lo
  std::vector<float> gsum;     // [M, K/G]: the group's float sum of x
};

inline void size_rows(QuantRows& r, int64_t m, int64_t k, int64_t group) {
  r.hi.resize(m * k);
  r.lo.resize(m * k);
  r.scale.resize(m * k / 32);
  r.qsum.resize(m * k / 32);
  r.gsum.assign(m * k / group, 0.0f);
}

// Row i of x into r (sized by size_rows).
inline void quantize_row(QuantRows& r, const bf16* x, int64_t i, int64_t k, int64_t group) {
  const int64_t nb = k / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const bf16* xb = x + b * 32;
    const F8 v[4] = {load_bf16(xb), load_bf16(xb + 8), load_bf16(xb + 16), load_bf16(xb + 24)};
    const float amax = hmax(max(max(abs(v[0]), abs(v[1])), max(abs(v[2]), abs(v[3]))));
    const F8 inv = set1(amax > 0 ? 127.0f / amax : 0.0f);
    I8 qs = round_int(zero());
    for (int h = 0; h < 4; ++h) {
      const F8 t = mul(v[h], inv);
      const I8 hi = round_int(t);
      const I8 lo = iclamp(round_int(mul(sub(t, to_float(hi)), set1(256.0f))), -127, 127);
      store_int8(r.hi.data() + i * k + b * 32 + 8 * h, hi);
      store_int8(r.lo.data() + i * k + b * 32 + 8 * h, lo);
      qs = iadd(qs, iadd(ishl8(hi), lo));
    }
    r.scale[i * nb + b] = amax / 127.0f / 256.0f;
    r.qsum[i * nb + b] = ihsum(qs);
    // the 32 values' sum in _mm512_reduce_add_ps's order over the 16 lanes v[j] + v[16 + j]
    r.gsum[i * (k / group) + b * 32 / group] += reduce16(add(v[0], v[2]), add(v[1], v[3]));
  }
}

// Rows [r0, r0 + M) x output block b (quant_gemm.cpp's tile): per 32-input block, the exact int32 sums of
// weight x hi and weight x lo, combined as 256 hi-sum + lo-sum (less 128 x the block's sum for 8-bit's + 128)
// and scaled in fp32; 4-bit adds min x the group's sum of x.
template <int M, int BITS>
inline void quant_tile(const QuantView& w, const QuantRows& a, int64_t r0, const float* bias, bf16* y, int64_t b) {
  const int64_t k = w.k, ng = w.groups(), nb32 = k / 32, per_group = w.group / 32;
  F8 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
  for (int64_t g = 0; g < ng; ++g) {
    const F8 sc0 = load_half(w.scale + (b * ng + g) * kBlockN), sc1 = load_half(w.scale + (b * ng + g) * kBlockN + 8);
    for (int64_t blk = g * per_group; blk < (g + 1) * per_group; ++blk) {
      I16 ih[M], il[M];
      const int32_t *xh[M], *xl[M];
      for (int m = 0; m < M; ++m) {
        xh[m] = reinterpret_cast<const int32_t*>(a.hi.data() + (r0 + m) * k + blk * 32);
        xl[m] = reinterpret_cast<const int32_t*>(a.lo.data() + (r0 + m) * k + blk * 32);
        ih[m] = il[m] = izero();
      }
      if constexpr (BITS == 8) {
        const uint8_t* base = w.q + b * w.block_bytes() + blk * 8 * 64;
        for (int s = 0; s < 8; ++s) {
          prefetch(base + s * 64 + 1024);
          for (int m = 0; m < M; ++m) {
            dot8(ih[m], base + s * 64, xh[m][s]);
            dot8(il[m], base + s * 64, xl[m][s]);
          }
        }
      } else {
        const uint8_t* base = w.q + b * w.block_bytes() + blk * 4 * 64;
        prefetch(base + 1024);
        prefetch(base + 1024 + 128);
        for (int m = 0; m < M; ++m) dot4_block(ih[m], il[m], base, xh[m], xl[m]);
      }
      for (int m = 0; m < M; ++m) {
        const F8 xs = set1(a.scale[(r0 + m) * nb32 + blk]);
        // the signed sums of 8-bit weights already hold what AVX-512 takes back out as 128 x the block's sum
        F8 t0, t1;
        combine(ih[m], il[m], 0, t0, t1);
        acc[m][0] = fma(t0, mul(xs, sc0), acc[m][0]);
        acc[m][1] = fma(t1, mul(xs, sc1), acc[m][1]);
      }
    }
    if constexpr (BITS == 4) {
      const F8 mn0 = load_half(w.min + (b * ng + g) * kBlockN), mn1 = load_half(w.min + (b * ng + g) * kBlockN + 8);
      for (int m = 0; m < M; ++m) {
        const F8 gs = set1(a.gsum[(r0 + m) * ng + g]);
        acc[m][0] = fma(mn0, gs, acc[m][0]);
        acc[m][1] = fma(mn1, gs, acc[m][1]);
      }
    }
  }
  store_block<M>(acc, nullptr, bias ? bias + b * kBlockN : nullptr, y + r0 * w.n + b * kBlockN, w.n);
}

template <int BITS>
inline void quant_gemm_range(int64_t m, const QuantView& w, const QuantRows& a, const float* bias, bf16* y,
                             int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < m; r += 4) {
      switch (std::min<int64_t>(4, m - r)) {
        case 1: quant_tile<1, BITS>(w, a, r, bias, y, b); break;
        case 2: quant_tile<2, BITS>(w, a, r, bias, y, b); break;
        case 3: quant_tile<3, BITS>(w, a, r, bias, y, b); break;
        default: quant_tile<4, BITS>(w, a, r, bias, y, b); break;
      }
    }
}

// Block b's weights w = s * stored + mn (8 bits: mn = -128 s) rounded to bf16, written as a panel of the
// tile layout (K/2 x 16 pairs), so tile_gemm_range multiplies larger batches by it. Per-channel 8-bit weights
// (one group) may go as their integers q, exact in bf16, for the caller to scale the sums (integers_of).
inline bool integers_of(const QuantView& w) { return w.bits == 8 && w.group == w.k; }

// The stored bytes go in order: a unit of the packed layout holds 16 outputs x 4 bytes, which are k 4u..4u+3
// (8 bits) or, as low and high nibbles, k 8u..8u+3 and 8u+4..8u+7 (4 bits); a panel row holds the pairs
// (k, k + 1) of the 16 outputs. Each value is fma(stored, s, mn) rounded to bf16, as the AVX-512 dequantizer does.
inline void dequantize_panel(const QuantView& w, int64_t b, bf16* panel, bool integers = false) {
  const int64_t ng = w.groups(), per_unit = w.bits == 8 ? 4 : 8;
  const uint8_t* blk = w.q + b * w.block_bytes();
  float sc[16], mn[16];
  for (int64_t g = 0; g < ng; ++g) {
    if (integers) {   // q itself: stored - 128, exact in bf16
      for (int o = 0; o < 16; ++o) sc[o] = 1.0f, mn[o] = -128.0f;
    } else {
      store(sc, load_half(w.scale + (b * ng + g) * kBlockN));
      store(sc + 8, load_half(w.scale + (b * ng + g) * kBlockN + 8));
      if (w.bits == 4) {
        store(mn, load_half(w.min + (b * ng + g) * kBlockN));
        store(mn + 8, load_half(w.min + (b * ng + g) * kBlockN + 8));
      } else {
        for (int o = 0; o < 16; ++o) mn[o] = sc[o] * -128.0f;
      }
    }
    float sc2[32], mn2[32];   // each output's scale and minimum twice: the lanes of a panel row's (k, k + 1) pairs
    for (int o = 0; o < 16; ++o) sc2[2 * o] = sc2[2 * o + 1] = sc[o], mn2[2 * o] = mn2[2 * o + 1] = mn[o];
    for (int64_t u = g * w.group / per_unit; u < (g + 1) * w.group / per_unit; ++u) {
      const uint8_t* p = blk + u * 64;
      bf16* rows = panel + u * (per_unit / 2) * 32;   // per_unit / 2 panel rows of 32
      for (int r = 0; r < per_unit / 2; ++r) {        // row r: k 2r and 2r + 1 of the unit, for the 16 outputs
        const int e = (2 * r) % 4, shift = w.bits == 8 ? 0 : (r >= 2 ? 4 : 0);
        float v[32];
        for (int o = 0; o < 16; ++o) {
          v[2 * o] = static_cast<float>((p[o * 4 + e] >> shift) & (w.bits == 8 ? 0xFF : 0x0F));
          v[2 * o + 1] = static_cast<float>((p[o * 4 + e + 1] >> shift) & (w.bits == 8 ? 0xFF : 0x0F));
        }
        for (int j = 0; j < 32; j += 8) store_bf16(rows + r * 32 + j, fma(load(v + j), load(sc2 + j), load(mn2 + j)));
      }
    }
  }
}

}  // namespace tm_portable

#endif  // TM_SIMD8
