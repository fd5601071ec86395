// What the two prompt-attention kernels share (amx_attention.cpp on AMX tiles, prefill_attention.cpp on AVX-512
// BF16): the checks on their arguments and K and V of a request repacked per KV head, 32 keys a step, in the
// layouts of AMX's B tiles. Include inside an AVX-512 F/BW guard.
//   K^T, per step: [2 key halves][32 d pairs][16 keys][2]: the 64 bytes at (half, pair) are 16 keys' values of
//        one pair of dims, so one 16-lane `dpbf16` against a query's broadcast pair scores 16 keys at once.
//   V, per step:   [4 d blocks][16 key pairs][16 d][2]: the 64 bytes at (block, pair) are 16 dims of two keys,
//        so one `dpbf16` against a pair of broadcast probabilities adds both keys to 16 dims of the output.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace tokenmill_prefill {

constexpr int64_t kD = 64;        // head dim
constexpr int64_t kKeys = 32;     // keys per step
constexpr int64_t kTile = 512;    // bf16 values in one 1 KB tile; a step of K (or V) is 4 of them

// One step of `keys` < 32 keys (the last one of a sequence), the rest as zeros.
inline void pack_kv_partial(const uint16_t* k, const uint16_t* v, int64_t kv_stride, int64_t keys, uint16_t* kt,
                            uint16_t* vt) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const bool real = j < keys;
    const uint16_t* kr = k + j * kv_stride;
    const uint16_t* vr = v + j * kv_stride;
    for (int64_t x = 0; x < kD; ++x) {
      kt[(j / 16) * 2 * kTile + (x / 2) * 32 + (j % 16) * 2 + x % 2] = real ? kr[x] : 0;
      vt[(x / 16) * kTile + (j / 2) * 32 + (x % 16) * 2 + j % 2] = real ? vr[x] : 0;
    }
  }
}

// One whole step of 32 keys, vectorised: K^T is a transpose of 32-bit d pairs (for each key half,
// word w of key j goes to w * 16 + j: one gather per word), V interleaves the rows of each key pair.
inline void pack_kv_step(const uint16_t* k, const uint16_t* v, int64_t kv_stride, uint16_t* kt, uint16_t* vt) {
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

// The query block that task slot i of a head walks, of `blocks`: 0, last, 1, last - 1, ... Both prompt kernels
// hand each thread a contiguous range of (head, slot) tasks; SmolLM2 has 9 query heads, so one head is split
// between the two threads, and in block order its first half (the causal triangle's short rows) is a quarter of its
// work: one thread got 4.25 heads' work and the other 4.75. In this order any run of slots is about its share.
inline int64_t zigzag_block(int64_t i, int64_t blocks) { return i % 2 == 0 ? i / 2 : blocks - 1 - i / 2; }

// The arguments both kernels take, checked, and the request's K and V packed for them.
// out [L, Hq, 64] (rows of this request), q [L, Hq, 64], k and v [S, Hkv, 64]; each may have any token stride.
// Causal: S = context + L, and query row r sits at position context + r and sees keys 0..context + r. Not
// causal: every row sees all S keys (a shared prefix, for cascade attention). lse: [L, Hq] fp32, optional.
struct PrefillArgs {
  int64_t rows, hq, hkv, group, seq_len, steps;
  float* lse = nullptr;
  int64_t lse_row = 0, lse_head = 0;
  std::unique_ptr<uint16_t[]> kp, vp;   // [Hkv][steps] packed steps of K^T and of V

  const uint16_t* k_of(int64_t kv_head) const { return kp.get() + kv_head * steps * 4 * kTile; }
  const uint16_t* v_of(int64_t kv_head) const { return vp.get() + kv_head * steps * 4 * kTile; }
};

inline PrefillArgs prepare_prefill(const char* name, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, int64_t context, bool causal,
                                   const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              name, ": bf16 only");
  TORCH_CHECK(q.size(2) == kD && k.size(2) == kD && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  out.stride(2) == 1 && q.stride(1) == kD && k.stride(1) == kD && v.stride(1) == kD &&
                  out.stride(1) == kD,
              name, ": head_dim 64, heads packed in each row");
  TORCH_CHECK(k.stride(0) == v.stride(0), name, ": k and v must share a row stride");
  PrefillArgs a;
  a.rows = q.size(0), a.hq = q.size(1), a.hkv = k.size(1), a.seq_len = k.size(0);
  TORCH_CHECK((!causal || a.seq_len == context + a.rows) && a.seq_len > 0 && a.hq % a.hkv == 0, name, ": shapes");
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->size(0) == a.rows && lse->size(1) == a.hq,
                "lse: [L, Hq] fp32");
    a.lse = lse->data_ptr<float>();
    a.lse_row = lse->stride(0);
    a.lse_head = lse->stride(1);
  }
  a.group = a.hq / a.hkv;
  a.steps = (a.seq_len + kKeys - 1) / kKeys;
  // every tile of both buffers is written by the packing below (padding keys as zeros): no need to clear them
  const int64_t packed = a.hkv * a.steps * 4 * kTile;
  a.kp.reset(new uint16_t[packed]);
  a.vp.reset(new uint16_t[packed]);
  const auto* k_p = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* v_p = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t steps = a.steps, seq_len = a.seq_len;
  uint16_t *kp = a.kp.get(), *vp = a.vp.get();
  at::parallel_for(0, a.hkv * steps, 8, [&](int64_t b, int64_t e) {
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
  return a;
}

}  // namespace tokenmill_prefill
