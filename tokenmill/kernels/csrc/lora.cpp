// Batched LoRA for the tokens of one step, each with its own adapter (a slot of the stacked weights):
//   y[t] += B[slot(t)] @ (A[slot(t)] @ x[t])        for every token t with an adapter
// The tokens come grouped by slot (a segmented matmul): four tokens of one slot share each weight load.
// a: [slots * shards * r, in] (rows: slot, shard, rank), b_t: [slots * shards * r, out] (B transposed; shard k's
// rows hold values only in its columns [off_k, off_k+1)), both kept in fp32 (no conversion in the inner loops;
// they are small); x and y bf16, y rounded once. Each token reads
// only its own adapter's rows, where the torch path multiplies every token by every slot in play and masks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "bf16_rows.h"

namespace {

constexpr int kTok = 4;   // tokens of one slot computed together: each weight load feeds four of them

// h[i][j] = dot(x[i], a[j]) for kTok token rows x[i] and `rows` weight rows of length n, four weight rows per pass.
void shrink(float (*h)[64], const bf16* const* x, const float* a, int64_t lda, int64_t rows, int64_t n) {
  for (int64_t j = 0; j < rows; j += 4) {
    __m512 s[kTok][4];
    for (auto& si : s) for (auto& v : si) v = _mm512_setzero_ps();
    const int64_t nr = rows - j < 4 ? rows - j : 4;
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 mk = mask_at(c, n);
      __m512 av[4];
      for (int q = 0; q < 4; ++q) av[q] = q < nr ? _mm512_maskz_loadu_ps(mk, a + (j + q) * lda + c) : _mm512_setzero_ps();
      for (int i = 0; i < kTok; ++i) {
        const __m512 xv = load16(x[i] + c, mk);
        for (int q = 0; q < 4; ++q) s[i][q] = _mm512_fmadd_ps(xv, av[q], s[i][q]);
      }
    }
    for (int i = 0; i < kTok; ++i)
      for (int q = 0; q < nr; ++q) h[i][j + q] = _mm512_reduce_add_ps(s[i][q]);
  }
}

// y[i][c0:c1] += sum_j h[i][j] * b[j, c0:c1] for the block's valid tokens, 32 columns of four tokens in registers.
void expand(bf16* const* y, int nt, float (*h)[64], int64_t h0, const float* b, int64_t ldb, int64_t rows,
            int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += 32) {
    const __mmask16 m0 = mask_at(c, c1), m1 = c + 16 < c1 ? mask_at(c + 16, c1) : static_cast<__mmask16>(0);
    __m512 acc[kTok][2];
    for (int i = 0; i < kTok; ++i) {
      acc[i][0] = load16(y[i] + c, m0);
      acc[i][1] = load16(y[i] + c + 16, m1);
    }
    for (int64_t j = 0; j < rows; ++j) {
      const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + j * ldb + c), b1 = _mm512_maskz_loadu_ps(m1, b + j * ldb + c + 16);
      for (int i = 0; i < kTok; ++i) {
        const __m512 hj = _mm512_set1_ps(h[i][h0 + j]);
        acc[i][0] = _mm512_fmadd_ps(hj, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(hj, b1, acc[i][1]);
      }
    }
    for (int i = 0; i < nt; ++i) {
      store16(y[i] + c, acc[i][0], m0);
      store16(y[i] + c + 16, acc[i][1], m1);
    }
  }
}

// order: the step's adapted tokens grouped by slot; slot s's are order[seg[s]:seg[s+1]].
void lora_sgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t, const at::Tensor& order,
               const at::Tensor& seg, std::vector<int64_t> offsets, int64_t rank) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &x, &a, &b_t}) {
    TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1, "lora_sgmv: y, x, a and b_t are matrices with contiguous rows");
  }
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && a.scalar_type() == at::kFloat &&
              b_t.scalar_type() == at::kFloat, "lora_sgmv: y and x are bf16, a and b_t fp32");
  const int64_t tokens = x.size(0), in = x.size(1), out = y.size(1), shards = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK(y.size(0) == tokens && a.size(1) == in && b_t.size(1) == out && a.size(0) == b_t.size(0),
              "lora_sgmv: shapes of y, x, a, b_t do not agree");
  TORCH_CHECK(shards >= 1 && offsets.back() == out, "lora_sgmv: offsets must end at y's width");
  const int64_t width = shards * rank, slots = seg.numel() - 1;
  TORCH_CHECK(width <= 64, "lora_sgmv: shards * rank must be at most 64");
  TORCH_CHECK(order.scalar_type() == at::kInt && seg.scalar_type() == at::kInt && order.is_contiguous() &&
              seg.is_contiguous() && slots >= 1 && slots * width <= a.size(0), "lora_sgmv: bad order or seg");
  const int32_t* op = order.data_ptr<int32_t>();
  const int32_t* sp = seg.data_ptr<int32_t>();
  TORCH_CHECK(sp[0] == 0 && sp[slots] == order.numel(), "lora_sgmv: seg must span order");
  for (int64_t i = 0; i < order.numel(); ++i) TORCH_CHECK(op[i] >= 0 && op[i] < tokens, "lora_sgmv: bad token");
  std::vector<std::pair<int64_t, int64_t>> blocks;   // (slot, first position in order)
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t p = sp[s]; p < sp[s + 1]; p += kTok) blocks.emplace_back(s, p);
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr());
  const float* ap = a.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    float h[kTok][64];
    for (int64_t w = begin; w < end; ++w) {
      const auto [s, p] = blocks[w];
      const int nt = static_cast<int>(std::min<int64_t>(kTok, sp[s + 1] - p));
      const bf16* xs[kTok];
      bf16* ys[kTok];
      for (int i = 0; i < kTok; ++i) {   // a short block repeats its last token (computed, not stored)
        const int64_t t = op[p + (i < nt ? i : nt - 1)];
        xs[i] = xp + t * x.stride(0);
        ys[i] = yp + t * y.stride(0);
      }
      const int64_t row0 = s * width;
      shrink(h, xs, ap + row0 * a.stride(0), a.stride(0), width, in);
      for (int64_t k = 0; k < shards; ++k) {
        expand(ys, nt, h, k * rank, bp + (row0 + k * rank) * b_t.stride(0), b_t.stride(0), rank, offsets[k],
               offsets[k + 1]);
      }
    }
  });
}

}  // namespace

TM_LIBRARY_FRAGMENT(m) {
  m.def("lora_sgmv(Tensor(a!) y, Tensor x, Tensor a, Tensor b_t, Tensor order, Tensor seg, int[] offsets, "
        "int rank) -> ()");
}

TM_LIBRARY_IMPL(CPU, m) { m.impl("lora_sgmv", &lora_sgmv); }

#endif
