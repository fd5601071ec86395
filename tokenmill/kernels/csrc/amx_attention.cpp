// Causal attention of one request's new tokens (a prompt, or a chunk after `context` earlier tokens) on AMX
// tiles, for bf16 with head_dim 64. torch's CPU flash attention reaches ~400 GFLOP/s here; prompts are a
// third of a prefill-heavy step, so they get their own kernel.
//
// K and V of the request are first repacked per KV head into tile layouts (K^T and V, in pairs of rows).
// Then each task takes one query head and 16 query positions, and walks the keys 32 at a time:
//   S = Q K^T       tile 0 holds half of Q (d 0-31 or 32-63), 1 a K tile, 2,3 the scores of 16 keys each
//   online softmax  on the stored scores in fp32 (AVX-512), masked on the diagonal, P rounded to bf16
//   O += P V        tile 0 holds P, 1 a V tile, 4-7 the four 16-wide column blocks of O for the whole walk

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx.h"
#include "vec_math.h"

namespace {

constexpr int64_t kD = 64;        // head dim
constexpr int64_t kQ = 16;        // query positions per task
constexpr int64_t kKeys = 32;     // keys per step
constexpr int64_t kTile = 512;    // bf16 values in one 1 KB tile

// K of one KV head as B tiles of K^T: for each 32-key step, [2 key halves][2 d halves][16 d pairs][16 keys][2].
// V as B tiles: for each 32-key step, [4 d blocks][16 key pairs][16 d][2]. This packs one step of `keys` < 32
// keys (the last one of a sequence), the rest as zeros; pack_kv_step below packs whole steps.
void pack_kv_partial(const uint16_t* k, const uint16_t* v, int64_t kv_stride, int64_t keys, uint16_t* kt,
                     uint16_t* vt) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const bool real = j < keys;
    const uint16_t* kr = k + j * kv_stride;
    const uint16_t* vr = v + j * kv_stride;
    for (int64_t x = 0; x < kD; ++x) {
      // K^T tile (key half j / 16, d half x / 32): row = d pair, column = key, element = d within the pair
      kt[((j / 16) * 2 + x / 32) * kTile + ((x % 32) / 2) * 32 + (j % 16) * 2 + x % 2] = real ? kr[x] : 0;
      // V tile (d block x / 16): row = key pair, column = d, element = key within the pair
      vt[(x / 16) * kTile + (j / 2) * 32 + (x % 16) * 2 + j % 2] = real ? vr[x] : 0;
    }
  }
}

// One whole step of 32 keys, vectorised: K^T is a transpose of 32-bit d pairs (for each key half,
// word w of key j goes to w * 16 + j: one gather per word), V interleaves the rows of each key pair.
void pack_kv_step(const uint16_t* k, const uint16_t* v, int64_t kv_stride, uint16_t* kt, uint16_t* vt) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(kv_stride / 2)));
  for (int64_t half = 0; half < 2; ++half) {
    const int32_t* src = reinterpret_cast<const int32_t*>(k + half * 16 * kv_stride);
    int32_t* dst = reinterpret_cast<int32_t*>(kt + half * 2 * kTile);
    for (int64_t w = 0; w < kD / 2; ++w) _mm512_storeu_si512(dst + w * 16, _mm512_i32gather_epi32(rows, src + w, 4));
  }
  alignas(64) static const int16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const int16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t pr = 0; pr < kKeys / 2; ++pr) {
    const uint16_t* a = v + 2 * pr * kv_stride;
    const uint16_t* b = a + kv_stride;
    for (int64_t h = 0; h < 2; ++h) {  // d 0-31, then 32-63
      const __m512i x = _mm512_loadu_si512(a + 32 * h), y = _mm512_loadu_si512(b + 32 * h);
      _mm512_storeu_si512(vt + (2 * h) * kTile + pr * 32, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vt + (2 * h + 1) * kTile + pr * 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// One query head, query rows [r0, r0 + kQ) of this request (positions context + r), all their keys.
// O accumulates in tiles 4-7 across the whole walk: the softmax uses a running maximum that is only raised
// when a score exceeds it by more than kLazy (then the tiles are flushed and rescaled), so most steps need no
// rescaling; exp(score - max) stays below e^kLazy, far inside fp32 and bf16 range.
constexpr float kLazy = 8.0f;

// Causal: row r sees keys 0..context + r0 + r. Not causal: every row sees all seq_len keys. lse, when given,
// receives each row's log-sum-exp of its scaled scores (at lse + r * lse_stride).
void attend_block(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* kp, const uint16_t* vp,
                  int64_t context, int64_t seq_len, bool causal, int64_t r0, float scale, uint16_t* out,
                  int64_t out_stride, float* lse, int64_t lse_stride) {
  alignas(64) float s[kQ * kKeys];
  alignas(64) float o[kQ * kD];
  alignas(64) float lv[kQ * 16];   // per row, a vector of partial sums of P
  alignas(64) uint16_t p[kQ * kKeys];
  alignas(64) uint16_t qbuf[kQ * kD];
  float m[kQ];
  std::fill(lv, lv + kQ * 16, 0.0f);
  std::fill(m, m + kQ, -std::numeric_limits<float>::infinity());
  const int64_t n = std::min(kQ, rows - r0);
  // Q tiles are loaded from a copy: rows past the request's end repeat its last row (computed, never stored)
  for (int64_t r = 0; r < kQ; ++r) std::memcpy(qbuf + r * kD, q + (r0 + std::min(r, n - 1)) * q_stride, kD * 2);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const int64_t steps = causal ? (context + r0 + n - 1) / kKeys + 1 : (seq_len + kKeys - 1) / kKeys;
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t st = 0; st < steps; ++st) {
    const uint16_t* kt = kp + st * 4 * kTile;
    _tile_zero(2);
    _tile_zero(3);
    TILE_LOAD(0, qbuf, kD * 2);
    TILE_LOAD(1, kt, 64);
    _tile_dpbf16ps(2, 0, 1);
    TILE_LOAD(1, kt + 2 * kTile, 64);
    _tile_dpbf16ps(3, 0, 1);
    TILE_LOAD(0, qbuf + 32, kD * 2);
    TILE_LOAD(1, kt + kTile, 64);
    _tile_dpbf16ps(2, 0, 1);
    TILE_LOAD(1, kt + 3 * kTile, 64);
    _tile_dpbf16ps(3, 0, 1);
    _tile_stored(2, s, kKeys * 4);
    _tile_stored(3, s + 16, kKeys * 4);
    const int64_t key0 = st * kKeys;
    bool flush = false;
    float grow[kQ];
    for (int64_t r = 0; r < kQ; ++r) {
      grow[r] = 1.0f;
      const int64_t visible = r >= n ? 0 : causal ? context + r0 + r - key0 + 1 : seq_len - key0;  // keys it sees
      const __mmask16 ma = visible >= 16 ? 0xFFFF : visible <= 0 ? 0 : static_cast<__mmask16>((1u << visible) - 1);
      const __mmask16 mb = visible >= 32 ? 0xFFFF : visible <= 16 ? 0
                                                                  : static_cast<__mmask16>((1u << (visible - 16)) - 1);
      if (!ma) {
        _mm512_store_si512(p + r * kKeys, _mm512_setzero_si512());
        continue;
      }
      const __m512 a = _mm512_mask_mov_ps(ninf, ma, _mm512_load_ps(s + r * kKeys));
      const __m512 b = _mm512_mask_mov_ps(ninf, mb, _mm512_load_ps(s + r * kKeys + 16));
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(a, b)) * scale;
      if (top > m[r] + kLazy) {
        if (m[r] != -INFINITY) {  // this row's O and sum were accumulated against the old maximum
          grow[r] = std::exp(m[r] - top);
          flush = true;
        }
        m[r] = top;
      }
      const __m512 vm = _mm512_set1_ps(m[r]);
      const __m512 pa = _mm512_maskz_mov_ps(ma, exp512(_mm512_fmsub_ps(a, vscale, vm)));
      const __m512 pb = _mm512_maskz_mov_ps(mb, exp512(_mm512_fmsub_ps(b, vscale, vm)));
      // P rounded to bf16; the row sum is taken of the rounded values that multiply V
      const __m512i hp = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(pa)),
                                            (__m256i)_mm512_cvtneps_pbh(pb), 1);
      _mm512_store_si512(p + r * kKeys, hp);
      const __m512 sum = _mm512_add_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(hp)),
                                       _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(hp, 1)));
      _mm512_store_ps(lv + r * 16, _mm512_fmadd_ps(_mm512_load_ps(lv + r * 16), _mm512_set1_ps(grow[r]), sum));
    }
    if (flush) {  // rescale the rows whose maximum moved: through memory, rarely
      _tile_stored(4, o, kD * 4);
      _tile_stored(5, o + 16, kD * 4);
      _tile_stored(6, o + 32, kD * 4);
      _tile_stored(7, o + 48, kD * 4);
      for (int64_t r = 0; r < kQ; ++r)
        if (grow[r] != 1.0f)
          for (int64_t x = 0; x < kD; x += 16)
            _mm512_store_ps(o + r * kD + x, _mm512_mul_ps(_mm512_load_ps(o + r * kD + x), _mm512_set1_ps(grow[r])));
      TILE_LOAD(4, o, kD * 4);
      TILE_LOAD(5, o + 16, kD * 4);
      TILE_LOAD(6, o + 32, kD * 4);
      TILE_LOAD(7, o + 48, kD * 4);
    }
    const uint16_t* vt = vp + st * 4 * kTile;
    TILE_LOAD(0, p, kKeys * 2);
    TILE_LOAD(1, vt, 64);
    _tile_dpbf16ps(4, 0, 1);
    TILE_LOAD(1, vt + kTile, 64);
    _tile_dpbf16ps(5, 0, 1);
    TILE_LOAD(1, vt + 2 * kTile, 64);
    _tile_dpbf16ps(6, 0, 1);
    TILE_LOAD(1, vt + 3 * kTile, 64);
    _tile_dpbf16ps(7, 0, 1);
  }
  _tile_stored(4, o, kD * 4);
  _tile_stored(5, o + 16, kD * 4);
  _tile_stored(6, o + 32, kD * 4);
  _tile_stored(7, o + 48, kD * 4);
  for (int64_t r = 0; r < n; ++r) {
    const float sum = _mm512_reduce_add_ps(_mm512_load_ps(lv + r * 16));
    if (lse) lse[r * lse_stride] = m[r] + std::log(sum);
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int64_t x = 0; x < kD; x += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * kD + x), inv)));
  }
}

// out [L, Hq, 64] (rows of this request), q [L, Hq, 64], k and v [S, Hkv, 64]; each may have any token stride.
// Causal: S = context + L, and query row r sits at position context + r and sees keys 0..context + r. Not
// causal: every row sees all S keys (a shared prefix, for cascade attention). lse: [L, Hq] fp32, optional.
void amx_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t context, bool causal, const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "amx_prefill_attention: bf16 only");
  TORCH_CHECK(q.size(2) == kD && k.size(2) == kD && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  out.stride(2) == 1 && q.stride(1) == kD && k.stride(1) == kD && v.stride(1) == kD &&
                  out.stride(1) == kD,
              "amx_prefill_attention: head_dim 64, heads packed in each row");
  TORCH_CHECK(k.stride(0) == v.stride(0), "amx_prefill_attention: k and v must share a row stride");
  TORCH_CHECK(tokenmill_amx::permitted(), "amx_prefill_attention: this CPU or kernel does not allow AMX");
  const int64_t rows = q.size(0), hq = q.size(1), hkv = k.size(1), seq_len = k.size(0);
  TORCH_CHECK((!causal || seq_len == context + rows) && seq_len > 0 && hq % hkv == 0, "amx_prefill_attention: shapes");
  float* lse_p = nullptr;
  int64_t lse_row = 0, lse_head = 0;
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->size(0) == rows && lse->size(1) == hq, "lse: [L, Hq] fp32");
    lse_p = lse->data_ptr<float>();
    lse_row = lse->stride(0);
    lse_head = lse->stride(1);
  }
  const int64_t group = hq / hkv, steps = (seq_len + kKeys - 1) / kKeys;
  // every tile of both buffers is written by the packing below (padding keys as zeros): no need to clear them
  const int64_t packed = hkv * steps * 4 * kTile;
  std::unique_ptr<uint16_t[]> kp_buf(new uint16_t[packed]), vp_buf(new uint16_t[packed]);
  uint16_t* kp = kp_buf.get();
  uint16_t* vp = vp_buf.get();
  const auto* k_p = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* v_p = reinterpret_cast<const uint16_t*>(v.data_ptr());
  at::parallel_for(0, hkv * steps, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / steps, st = t % steps;
      const int64_t keys = std::min(kKeys, seq_len - st * kKeys);
      // keys st*32 .. st*32+31 of head h
      const uint16_t* ks = k_p + st * kKeys * k.stride(0) + h * kD;
      const uint16_t* vs = v_p + st * kKeys * v.stride(0) + h * kD;
      uint16_t* kt = kp + (h * steps + st) * 4 * kTile;
      uint16_t* vt = vp + (h * steps + st) * 4 * kTile;
      if (keys == kKeys)
        pack_kv_step(ks, vs, k.stride(0), kt, vt);
      else
        pack_kv_partial(ks, vs, k.stride(0), keys, kt, vt);
    }
  });
  const auto* q_p = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* o_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (rows + kQ - 1) / kQ;
  at::parallel_for(0, hq * blocks, 1, [&](int64_t b, int64_t e) {
    tokenmill_amx::configure_tiles();
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / blocks, qb = t % blocks, kvh = h / group;
      attend_block(q_p + h * kD, q.stride(0), rows, kp + kvh * steps * 4 * kTile,
                   vp + kvh * steps * 4 * kTile, context, seq_len, causal, qb * kQ, static_cast<float>(scale),
                   o_p + qb * kQ * out.stride(0) + h * kD, out.stride(0),
                   lse_p ? lse_p + qb * kQ * lse_row + h * lse_head : nullptr, lse_row);
    }
    _tile_release();
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("amx_prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, int context, "
        "bool causal=True, Tensor(b!)? lse=None) -> ()");
}
TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("amx_prefill_attention", &amx_prefill_attention); }

#endif
