// The kernels that decoder_stack.cpp calls directly, with no Python and no dispatcher in between. Each is
// defined beside its op, in its own file, under the same CPU-feature guard as the op: a caller keeps to
// those guards too. Where a build has no AVX-512 BF16 / VNNI, portable_ops.cpp defines the same names.
#pragma once

#include <ATen/ATen.h>

namespace tokenmill_native {

// tiled_gemm.cpp (AVX-512 BF16)
at::Tensor tiled_skinny_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n);
at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated);
at::Tensor vec_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                    bool gated);
bool amx_permitted();  // built with AMX, the CPU has it and Linux grants its state
// quant_gemm.cpp (AVX-512 VNNI)
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                      int64_t group, int64_t n);
// quant_tiles.cpp (AVX-512 BF16; quant_amx_gemm also AMX)
at::Tensor quant_vec_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated);
at::Tensor quant_amx_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& min, const c10::optional<at::Tensor>& bias, int64_t bits,
                          int64_t group, int64_t n, bool gated);
// fused_ops.cpp (AVX-512 BF16)
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rope_and_cache(at::Tensor q_out, at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    int64_t hq, int64_t hkv, double k_scale, double v_scale,
                    const c10::optional<at::Tensor>& k_offset);
// paged_attention.cpp (any CPU)
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& rows, double scale, int64_t start_block, const c10::optional<at::Tensor>& lse,
                     double k_scale, double v_scale, int64_t window, bool amx);

// Prompt attention (prefill_attention.cpp; amx_attention.cpp where built with AMX) and the cascade's merge of a
// shared prefix's partial result into the per-request tails' (merge_attn.cpp).
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t context, bool causal, const c10::optional<at::Tensor>& lse);
void amx_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t context, bool causal, const c10::optional<at::Tensor>& lse);
void merge_attn_states(at::Tensor out, const at::Tensor& lse_tail, const at::Tensor& prefix_out,
                       const at::Tensor& prefix_lse, const at::Tensor& token_index);

}  // namespace tokenmill_native
