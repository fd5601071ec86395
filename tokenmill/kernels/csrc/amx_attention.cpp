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
#include "ops_library.h"
#include "native_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx.h"
#include "prefill_kv.h"
#include "vec_math.h"

namespace {

using namespace tokenmill_prefill;

constexpr int64_t kQ = 16;        // query positions per task

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

// The arguments as prefill_kv.h's prepare_prefill describes them.
void amx_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t context, bool causal, const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK(tokenmill_amx::permitted(), "amx_prefill_attention: this CPU or kernel does not allow AMX");
  const PrefillArgs a = prepare_prefill("amx_prefill_attention", out, q, k, v, context, causal, lse);
  const auto* q_p = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* o_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (a.rows + kQ - 1) / kQ;
  at::parallel_for(0, a.hq * blocks, 1, [&](int64_t b, int64_t e) {
    tokenmill_amx::configure_tiles();
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / blocks, qb = zigzag_block(t % blocks, blocks), kvh = h / a.group;
      attend_block(q_p + h * kD, q.stride(0), a.rows, a.k_of(kvh), a.v_of(kvh), context, a.seq_len, causal, qb * kQ,
                   static_cast<float>(scale), o_p + qb * kQ * out.stride(0) + h * kD, out.stride(0),
                   a.lse ? a.lse + qb * kQ * a.lse_row + h * a.lse_head : nullptr, a.lse_row);
    }
    _tile_release();
  });
}

}  // namespace

namespace tokenmill_native {
void amx_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t context, bool causal, const c10::optional<at::Tensor>& lse) {
  ::amx_prefill_attention(out, q, k, v, scale, context, causal, lse);
}
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("amx_prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, int context, "
        "bool causal=True, Tensor(b!)? lse=None) -> ()");
}
TM_LIBRARY_IMPL(CPU, m) { m.impl("amx_prefill_attention", &amx_prefill_attention); }

#endif
