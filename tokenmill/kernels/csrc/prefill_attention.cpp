// Causal attention of one request's new tokens (a prompt, or a chunk after `context` earlier tokens) with
// AVX-512 BF16, for CPUs without AMX (amx_attention.cpp has the AMX kernel): bf16, head_dim 64. torch's flash
// attention turns bf16 into fp32 for MKL's sgemm on such CPUs and reaches ~50-100 GFLOP/s on a prompt's heads
// (AMD Zen 5: 1.6 ms for one 256-token layer of SmolLM2); W1's prompts spent ~6 of its ~37 s there.
//
// K and V are packed per KV head as prefill_kv.h lays them out. Each task takes one query head and kRows query
// positions and walks the keys 32 at a time, with everything of those rows in registers:
//   S = Q K^T       per row, 2 x 16 scores: 32 `dpbf16` each against the row's broadcast pairs of dims
//   online softmax  in fp32, masked on the diagonal, P rounded to bf16 (as the AMX kernel does)
//   O += P V        per row, 4 x 16 dims of O: 16 key pairs x 4 `dpbf16` against broadcast pairs of P
// A row's maximum is only raised when a score exceeds it by more than kLazy (O and the sum are then rescaled),
// so most steps rescale nothing and exp(score - max) stays below e^kLazy; whether any score does is a vector
// compare, and the row's maximum is only reduced across lanes when one does. exp is a degree-3 polynomial (P is
// rounded to bf16 right after), and the row sum a `dpbf16` of P against ones. Those three took 10-15% off a
// 256-2,048-token prompt's attention on AMD Zen 5 (e4626e1:docs/benchmarks/2026-12-03-vec-gemm/prefill_ab.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"
#include "native_ops.h"

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "prefill_kv.h"

namespace {

using namespace tokenmill_prefill;

constexpr int kRows = 4;          // query positions of a row tile: 16 accumulators of O, 8 of scores
constexpr int64_t kBlockRows = 16;  // query positions per task: 4 row tiles take turns over each chunk of keys
constexpr int64_t kChunkSteps = 8;  // 256 keys: 64 KB of packed K and V
constexpr float kLazy = 8.0f;

inline __m512bh bcast_pair(const uint16_t* p) {  // the pair of bf16 values at p, in every lane
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// e^x for x <= kLazy (masked keys: -inf), to ~1.4e-4 relative: P is rounded to bf16 (2^-9) right after, so
// vec_math.h's exp512 (degree 6, 1e-7) is more than it keeps. 2^t = 2^floor(t) * poly3(frac(t)).
inline __m512 exp_p(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(0.07782313494317925f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22586840700541858f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6961721143196159f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9998636940628648f));
  return _mm512_scalef_ps(p, fi);
}

inline __mmask16 first_lanes(int64_t n) {  // the lanes below n, for n in any range
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// Query rows [r0, r0 + kRows) of one head (those below `rows` are real; the others repeat the last real row and
// are computed, never stored), and where their walk over the keys stands: O, the sums and maxima so far.
// Causal: row r sees keys 0..context + r. Not causal: every row sees all seq_len keys.
struct RowTile {
  const uint16_t* q[kRows];
  int64_t limit[kRows];  // keys each row sees
  int64_t r0, n, steps;  // steps: 32-key steps its last row needs
  __m512 o[kRows][4], lsum[kRows];
  float m[kRows];

  void start(const uint16_t* q0, int64_t q_stride, int64_t rows, int64_t first, int64_t context, int64_t seq_len,
             bool causal) {
    r0 = first;
    n = std::min<int64_t>(kRows, rows - first);
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = r0 + std::min<int64_t>(r, n - 1);
      q[r] = q0 + row * q_stride;
      limit[r] = causal ? context + row + 1 : seq_len;
      for (int x = 0; x < 4; ++x) o[r][x] = _mm512_setzero_ps();
      lsum[r] = _mm512_setzero_ps();
      m[r] = -std::numeric_limits<float>::infinity();
    }
    steps = (limit[kRows - 1] + kKeys - 1) / kKeys;
  }

  // Steps [st0, st1) of the keys: the tile's state in registers for the walk, back to memory after it.
  void walk(const uint16_t* kp, const uint16_t* vp, int64_t st0, int64_t st1, float scale) {
    __m512 acc[kRows][4], ls[kRows];
    for (int r = 0; r < kRows; ++r) {
      for (int x = 0; x < 4; ++x) acc[r][x] = o[r][x];
      ls[r] = lsum[r];
    }
    alignas(64) uint16_t p[kRows][kKeys];
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0: a dpbf16 against it sums P's pairs
    for (int64_t st = st0; st < st1; ++st) {
      const uint16_t* kt = kp + st * 4 * kTile;
      const uint16_t* vt = vp + st * 4 * kTile;
      // each row's scores as two sums (even and odd pairs of dims) added at the end: 16 chains of dpbf16s
      // instead of 8 keep both of a core's units busy (one chain per key half ran 10-20% slower on AMD Zen 5)
      __m512 s[kRows][2], odd[kRows][2];
      for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
      for (int64_t pr = 0; pr < kD / 2; pr += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + pr * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + 2 * kTile + pr * 32);
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kt + (pr + 1) * 32);
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kt + 2 * kTile + (pr + 1) * 32);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh qe = bcast_pair(q[r] + 2 * pr), qo = bcast_pair(q[r] + 2 * pr + 2);
          s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qe);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qe);
          odd[r][0] = _mm512_dpbf16_ps(odd[r][0], k2, qo);
          odd[r][1] = _mm512_dpbf16_ps(odd[r][1], k3, qo);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        s[r][0] = _mm512_add_ps(s[r][0], odd[r][0]);
        s[r][1] = _mm512_add_ps(s[r][1], odd[r][1]);
      }
      const int64_t key0 = st * kKeys;
      for (int r = 0; r < kRows; ++r) {
        const int64_t visible = limit[r] - key0;
        const __mmask16 ma = first_lanes(visible), mb = first_lanes(visible - 16);
        if (!ma) {  // a row above the diagonal of this step: nothing to add
          _mm512_store_si512(p[r], _mm512_setzero_si512());
          continue;
        }
        const __m512 a = _mm512_mask_mov_ps(ninf, ma, _mm512_mul_ps(s[r][0], vscale));
        const __m512 b = _mm512_mask_mov_ps(ninf, mb, _mm512_mul_ps(s[r][1], vscale));
        const __m512 thr = _mm512_set1_ps(m[r] + kLazy);
        if (_mm512_cmp_ps_mask(a, thr, _CMP_GT_OQ) | _mm512_cmp_ps_mask(b, thr, _CMP_GT_OQ)) {
          const float top = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
          if (m[r] != -INFINITY) {  // this row's O and sum were accumulated against the old maximum
            const __m512 grow = _mm512_set1_ps(std::exp(m[r] - top));
            for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_mul_ps(acc[r][x], grow);
            ls[r] = _mm512_mul_ps(ls[r], grow);
          }
          m[r] = top;
        }
        const __m512 vm = _mm512_set1_ps(m[r]);
        const __m512 pa = _mm512_maskz_mov_ps(ma, exp_p(_mm512_sub_ps(a, vm)));
        const __m512 pb = _mm512_maskz_mov_ps(mb, exp_p(_mm512_sub_ps(b, vm)));
        // P rounded to bf16 (keys 0-15, then 16-31); the row sum is taken of the rounded values that multiply V
        const __m512bh hp = _mm512_cvtne2ps_pbh(pb, pa);
        _mm512_store_si512(p[r], (__m512i)hp);
        ls[r] = _mm512_dpbf16_ps(ls[r], hp, ones);
      }
      for (int64_t pr = 0; pr < kKeys / 2; ++pr) {
        __m512bh vv[4];
        for (int x = 0; x < 4; ++x) vv[x] = (__m512bh)_mm512_loadu_si512(vt + x * kTile + pr * 32);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh pp = bcast_pair(p[r] + 2 * pr);
          for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], vv[x], pp);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int x = 0; x < 4; ++x) o[r][x] = acc[r][x];
      lsum[r] = ls[r];
    }
  }

  // The real rows' outputs (and log-sum-exps of their scaled scores, at lse + r * lse_stride, when given).
  void finish(uint16_t* out, int64_t out_stride, float* lse, int64_t lse_stride) const {
    for (int r = 0; r < n; ++r) {
      const float sum = _mm512_reduce_add_ps(lsum[r]);
      if (lse) lse[r * lse_stride] = m[r] + std::log(sum);
      const __m512 inv = _mm512_set1_ps(1.0f / sum);
      for (int x = 0; x < 4; ++x)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + 16 * x),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][x], inv)));
    }
  }
};

// The arguments as prefill_kv.h's prepare_prefill describes them.
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t context, bool causal, const c10::optional<at::Tensor>& lse) {
  const PrefillArgs a = prepare_prefill("prefill_attention", out, q, k, v, context, causal, lse);
  const auto* q_p = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* o_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (a.rows + kBlockRows - 1) / kBlockRows;
  const float sc = static_cast<float>(scale);
  // tasks in head-major order, each head's blocks in zigzag order (zigzag_block says why)
  at::parallel_for(0, a.hq * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / blocks, r0 = zigzag_block(t % blocks, blocks) * kBlockRows, kvh = h / a.group;
      const int64_t n = std::min(kBlockRows, a.rows - r0);
      const uint16_t* kp = a.k_of(kvh);
      const uint16_t* vp = a.v_of(kvh);
      RowTile tiles[kBlockRows / kRows];
      const int64_t count = (n + kRows - 1) / kRows;
      for (int64_t u = 0; u < count; ++u)
        tiles[u].start(q_p + h * kD, q.stride(0), a.rows, r0 + u * kRows, context, a.seq_len, causal);
      // the tiles take turns over each chunk of keys, which stays in L2 for all of them
      for (int64_t c = 0; c < tiles[count - 1].steps; c += kChunkSteps)
        for (int64_t u = 0; u < count; ++u) tiles[u].walk(kp, vp, c, std::min(c + kChunkSteps, tiles[u].steps), sc);
      for (int64_t u = 0; u < count; ++u) {
        const int64_t rr = tiles[u].r0;
        tiles[u].finish(o_p + rr * out.stride(0) + h * kD, out.stride(0),
                        a.lse ? a.lse + rr * a.lse_row + h * a.lse_head : nullptr, a.lse_row);
      }
    }
  });
}

}  // namespace

namespace tokenmill_native {
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t context, bool causal, const c10::optional<at::Tensor>& lse) {
  ::prefill_attention(out, q, k, v, scale, context, causal, lse);
}
}  // namespace tokenmill_native

TM_LIBRARY_FRAGMENT(m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, int context, "
        "bool causal=True, Tensor(b!)? lse=None) -> ()");
}
TM_LIBRARY_IMPL(CPU, m) { m.impl("prefill_attention", &prefill_attention); }

#endif
