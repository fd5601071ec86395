// rope_and_cache's argument checks, its dtype dispatch and its loop over tokens, shared by the AVX-512 build
// (fused_ops.cpp) and the portable one (portable_ops.cpp), which pass their own row kernels: `rope` rotates one
// head (out, in, cos, sin, d) and `store<Format>` writes one cache row (dst, src, n, 1 / scale, offset or null).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

namespace tm_rope {

using bf16 = uint16_t;

// The KV cache's formats, in the order by_cache_dtype passes them.
enum class CacheFormat { kBF16, kE4M3, kE5M2, kInt8 };

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bf16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, D] with contiguous rows");
}

// The checks both builds make; returns k_offset's data where a quantized cache uses one (else null).
inline const float* check_rope_and_cache(const at::Tensor& q_out, const at::Tensor& qkv, const at::Tensor& cos,
                                         const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         int64_t hq, int64_t hkv, const c10::optional<at::Tensor>& k_offset) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(q_out.is_contiguous() && q_out.scalar_type() == at::kBFloat16, "q_out must be contiguous bf16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin tables must be contiguous fp32");
  const int64_t d = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "qkv width does not match the heads");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == d && k_cache.size(2) == hkv, "cache rows");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(kv == at::kBFloat16 || (hkv * d) % 16 == 0, "a quantized cache needs rows of whole 16 values");
  if (!k_offset.has_value() || !k_offset->defined() || kv == at::kBFloat16) return nullptr;
  TORCH_CHECK(k_offset->scalar_type() == at::kFloat && k_offset->is_contiguous() && k_offset->numel() == hkv * d,
              "k_offset: [Hkv, D] contiguous fp32");
  return k_offset->data_ptr<float>();
}

// f(std::integral_constant<CacheFormat, F>{}) for the cache's dtype.
template <typename Fn>
void by_cache_dtype(at::ScalarType kv, Fn&& f) {
  using C = CacheFormat;
  if (kv == at::kBFloat16) f(std::integral_constant<C, C::kBF16>{});
  else if (kv == at::kFloat8_e4m3fn) f(std::integral_constant<C, C::kE4M3>{});
  else if (kv == at::kFloat8_e5m2) f(std::integral_constant<C, C::kE5M2>{});
  else if (kv == at::kChar) f(std::integral_constant<C, C::kInt8>{});
  else TORCH_CHECK(false, "rope_and_cache: KV cache dtype ", kv, " is not supported");
}

// qkv: [T, (Hq + 2 Hkv) * D] from the fused projection. q_out: [T, Hq, D]. k (rotated) stays in qkv and is copied
// with v into k_cache / v_cache [N, block_size, Hkv, D] at slot_mapping[t] (flat slot = block * block_size + i).
template <typename Rope, typename Store>
void rope_and_cache_rows(at::Tensor q_out, at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                         int64_t hq, int64_t hkv, float k_scale, float v_scale, const float* k_offset, Rope rope,
                         Store store) {
  const int64_t d = cos.size(1), row = qkv.stride(0);
  auto pos = positions.to(at::kLong).contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* qkvp = reinterpret_cast<bf16*>(qkv.data_ptr());
  auto* qo = reinterpret_cast<bf16*>(q_out.data_ptr());
  auto* kc = reinterpret_cast<char*>(k_cache.data_ptr());
  auto* vc = reinterpret_cast<char*>(v_cache.data_ptr());
  const int64_t item = k_cache.element_size();
  const int64_t bs = k_cache.size(1), kb = k_cache.stride(0) * item, ks = k_cache.stride(1) * item;
  const int64_t vb = v_cache.stride(0) * item, vs = v_cache.stride(1) * item;
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const float ik = 1.0f / k_scale, iv = 1.0f / v_scale;
  at::parallel_for(0, qkv.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      bf16* r = qkvp + t * row;
      const float* c = cp + pp[t] * d;
      const float* s = snp + pp[t] * d;
      for (int64_t h = 0; h < hq; ++h) rope(qo + (t * hq + h) * d, r + h * d, c, s, d);
      bf16* k = r + hq * d;
      for (int64_t h = 0; h < hkv; ++h) rope(k + h * d, k + h * d, c, s, d);
      const int64_t slot = sp[t], blk = slot / bs, off = slot % bs;
      store(kc + blk * kb + off * ks, k, hkv * d, ik, k_offset);
      store(vc + blk * vb + off * vs, k + hkv * d, hkv * d, iv, nullptr);
    }
  });
}

}  // namespace tm_rope
