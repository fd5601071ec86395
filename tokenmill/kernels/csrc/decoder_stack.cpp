// A Llama-family decoder's layers as one native call, for steps of decodes and prompt chunks (model/
// native_stack.py decides which). Eager Python spends ~6 ms of a batch-1 step of SmolLM2
// (30 layers, ~40 torch calls each) between kernels; this loop calls the same kernels, in the same order, on the
// same tensors, so its output is bit for bit the Python path's. It is the CPU's counterpart of a captured CUDA
// graph, and --enforce-eager turns it off as it turns graphs off in vLLM.
//
// Per layer: [add +] rms_norm -> qkv -> rope_and_cache -> paged_attention (or, for rows that share a cached
// prefix, the cascade: the tails, the prefix by the prompt kernel, merged), prompt chunks on the prompt kernel
// -> o_proj -> add + rms_norm -> gate_up (-> silu_and_mul, or the AMX matmul's gated epilogue) -> down; then the
// final add + rms_norm.
// A linear is either the tile layout (skinny kernel up to small_max_rows, the tile matmul up to max_rows, oneDNN's
// matmul on its prepacked weight beyond) or a quantized weight (VNNI kernel up to small_max_rows, the tile matmul
// over dequantized panels up to max_rows); the tile matmul runs on AMX where the CPU has it, else on AVX-512 BF16
// vectors (which take any batch). The limits are the Python layers' own (native_stack.py passes them), and the
// caller only sends steps whose row count every linear takes this way.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include "ops_library.h"

#include <vector>

#include "native_ops.h"
#include "simd8.h"

// The AVX-512 BF16 kernels, or the portable ones (portable_ops.cpp: AVX2, NEON) under the same names.
#if defined(__AVX512BF16__) || defined(TM_SIMD8)

namespace {

// y = x @ w^T + b by oneDNN on its prepacked weight: the op PackedWeight calls past its tile path.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                               c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                               c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

struct StackLinear {
  bool quantized = false;
  at::Tensor w;                 // AMX tiles, or the packed quantized bytes
  c10::optional<at::Tensor> onednn;  // tiles: the weight prepacked for oneDNN, for rows past max_rows
  at::Tensor scale;             // quantized: per-group scales
  c10::optional<at::Tensor> min, bias;
  int64_t n = 0, small_max_rows = 0, max_rows = 0, bits = 0, group = 0;
  bool gated_on_tiles = false;  // gate/up whose tile matmul can write silu(gate) * up itself (past small_max_rows)

  // The tile matmul of either kind, gated or not: on AMX where the CPU has it, else on vectors (as the Python
  // layers choose).
  at::Tensor tiles(const at::Tensor& x, bool gated) const {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tokenmill_native::amx_permitted()) {
      if (quantized) return tokenmill_native::quant_amx_gemm(x, w, scale, min, bias, bits, group, n, gated);
      return tokenmill_native::amx_gemm(x, w, bias, n, gated);
    }
#endif
    if (quantized) return tokenmill_native::quant_vec_gemm(x, w, scale, min, bias, bits, group, n, gated);
    return tokenmill_native::vec_gemm(x, w, bias, n, gated);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (rows > max_rows) {
      TORCH_CHECK(onednn.has_value(), "decoder stack: ", rows, " rows exceed this linear's native paths");
      return onednn_linear(x, *onednn, bias);
    }
    if (rows > small_max_rows) return tiles(x, false);
    if (!quantized) return tokenmill_native::tiled_skinny_gemm(x, w, bias, n);
    return tokenmill_native::quant_gemm(x, w, scale, min, bias, bits, group, n);  // VNNI, or portable_ops.cpp's
  }
};

struct StackLayer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  double k_scale = 1.0, v_scale = 1.0;
  c10::optional<at::Tensor> k_offset;  // a quantized cache's per-channel K offset, or none
  std::vector<StackLinear> linears;  // qkv, o, gate_up, down
};

struct DecoderStack : torch::CustomClassHolder {
  int64_t hq, hkv, head_dim;
  double eps, scale;
  at::Tensor cos, sin, final_norm;
  std::vector<StackLayer> layers;

  DecoderStack(int64_t hq, int64_t hkv, int64_t head_dim, double eps, double scale, at::Tensor cos, at::Tensor sin,
               at::Tensor final_norm)
      : hq(hq), hkv(hkv), head_dim(head_dim), eps(eps), scale(scale), cos(std::move(cos)), sin(std::move(sin)),
        final_norm(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache, double k_scale,
                 double v_scale, c10::optional<at::Tensor> k_offset) {
    layers.push_back(StackLayer{std::move(input_norm), std::move(post_norm), std::move(k_cache), std::move(v_cache),
                                k_scale, v_scale, std::move(k_offset), {}});
  }

  // Appends a linear to the last layer added: kind 0 the tile layout, 1 a quantized weight. Up to
  // small_max_rows rows its small-batch kernel (skinny or VNNI) runs, then the tile matmul up to max_rows, then
  // (tiles with a oneDNN-prepacked copy) oneDNN.
  void add_linear(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scale_, c10::optional<at::Tensor> min,
                  c10::optional<at::Tensor> bias, int64_t n, int64_t small_max_rows, int64_t max_rows, int64_t bits,
                  int64_t group, bool gated_on_tiles, c10::optional<at::Tensor> onednn) {
    TORCH_CHECK(!layers.empty() && layers.back().linears.size() < 4, "decoder stack: add_layer first, 4 linears each");
    StackLinear l;
    l.quantized = kind == 1;
    l.w = std::move(w);
    if (scale_.has_value()) l.scale = *scale_;
    l.min = std::move(min);
    l.bias = std::move(bias);
    l.n = n;
    l.small_max_rows = small_max_rows;
    l.max_rows = max_rows;
    l.bits = bits;
    l.group = group;
    l.gated_on_tiles = gated_on_tiles;
    l.onednn = std::move(onednn);
    layers.back().linears.push_back(std::move(l));
  }

  at::Tensor mlp(const StackLayer& layer, const at::Tensor& x) const {
    const StackLinear& gate_up = layer.linears[2];
    at::Tensor h;
    if (gate_up.gated_on_tiles && x.size(0) > gate_up.small_max_rows) {
      h = gate_up.tiles(x, true);
    } else {
      const at::Tensor gu = gate_up(x);
      h = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
      tokenmill_native::silu_and_mul(h, gu);
    }
    return layer.linears[3](h);
  }

  // The prompt kernel the Python layers pick (kernels.prefill_attention_op): on AMX tiles where the CPU has AMX.
  void prompt_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int64_t context, bool causal, const c10::optional<at::Tensor>& lse) const {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tokenmill_native::amx_permitted())
      return tokenmill_native::amx_prefill_attention(out, q, k, v, scale, context, causal, lse);
#endif
    tokenmill_native::prefill_attention(out, q, k, v, scale, context, causal, lse);
  }

  // Shared-prefix (cascade) attention, as the CPU backend's _cascade runs it (attention/cpu.py): the kernel
  // attends each row's tail past the prefix's blocks, the prompt kernel attends the prefix once for every new
  // token (not causal: all of them see all of it), and the two are merged by their log-sum-exps. The cache is
  // in the model dtype (bf16) and head_dim is 64: the caller sends no other step here.
  void cascade(const StackLayer& layer, at::Tensor& attn, const at::Tensor& q, const at::Tensor& block_table,
               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& rows, bool decode_amx,
               int64_t prefix_blocks, int64_t prefix_first_block, const c10::optional<at::Tensor>& prefix_block_ids,
               const at::Tensor& token_index, bool all_tokens) const {
    at::Tensor lse_tail = at::empty({q.size(0), hq}, q.options().dtype(at::kFloat));
    tokenmill_native::paged_attention(attn, q, layer.k_cache, layer.v_cache, block_table, seq_lens, query_start_loc,
                                      rows, scale, prefix_blocks, lse_tail, layer.k_scale, layer.v_scale, 0,
                                      decode_amx);
    auto prefix_of = [&](const at::Tensor& cache) {  // [S, Hkv, D]: a view when the blocks lie in order
      const at::Tensor blocks = prefix_first_block >= 0 ? cache.narrow(0, prefix_first_block, prefix_blocks)
                                                        : cache.index_select(0, *prefix_block_ids);
      return blocks.flatten(0, 1);
    };
    const at::Tensor qr = all_tokens ? q : q.index_select(0, token_index);
    const int64_t n = token_index.size(0), group = hq / hkv;
    at::Tensor o_pre = at::empty({n, hq, head_dim}, q.options());
    at::Tensor lse_pre = at::empty({n, hq}, q.options().dtype(at::kFloat));
    prompt_attention(o_pre, qr, prefix_of(layer.k_cache), prefix_of(layer.v_cache), 0, false, lse_pre);
    tokenmill_native::merge_attn_states(attn, lse_tail, o_pre.view({n, hkv, group, head_dim}),
                                        lse_pre.view({n, hkv, group}), token_index);
  }

  // The block ids each prompt span's keys are gathered from (the same for every layer): a chunk after cached
  // context its sequence's blocks, int64; a whole prompt none. spans: [n, 4] int64 rows of (start, end, batch row,
  // context).
  std::vector<at::Tensor> span_blocks(const at::Tensor& spans, const at::Tensor& block_table) const {
    TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 4,
                "decoder stack: prompt spans must be a contiguous [n, 4] int64 tensor");
    const int64_t block_size = layers.front().k_cache.size(1);
    const int64_t* s = spans.data_ptr<int64_t>();
    std::vector<at::Tensor> ids(spans.size(0));
    for (int64_t i = 0; i < spans.size(0); ++i) {
      const int64_t context = s[4 * i + 3], seq_len = context + s[4 * i + 1] - s[4 * i];
      if (context > 0)
        ids[i] = block_table.select(0, s[4 * i + 2]).narrow(0, 0, (seq_len + block_size - 1) / block_size)
                     .to(at::kLong);
    }
    return ids;
  }

  // Prompt chunks, each causal, on the prompt kernel, as the backend's native_prompt_row runs them: a whole prompt
  // over its fresh K/V (k as rope_and_cache left it in qkv), a chunk after `context` cached tokens over its
  // sequence's keys gathered from its cache blocks (bf16 caches only: the caller checks). blocks: span_blocks'.
  void prompts(const StackLayer& layer, at::Tensor& attn, const at::Tensor& q, const at::Tensor& qkv,
               const at::Tensor& spans, const std::vector<at::Tensor>& blocks) const {
    const int64_t t = qkv.size(0);
    const at::Tensor k = qkv.narrow(1, hq * head_dim, hkv * head_dim).view({t, hkv, head_dim});
    const at::Tensor v = qkv.narrow(1, (hq + hkv) * head_dim, hkv * head_dim).view({t, hkv, head_dim});
    const int64_t* s = spans.data_ptr<int64_t>();
    for (int64_t i = 0; i < spans.size(0); ++i) {
      const int64_t start = s[4 * i], len = s[4 * i + 1] - s[4 * i], context = s[4 * i + 3];
      at::Tensor ki = k.narrow(0, start, len), vi = v.narrow(0, start, len);
      if (context > 0) {  // the whole sequence, from its blocks
        ki = layer.k_cache.index_select(0, blocks[i]).flatten(0, 1).narrow(0, 0, context + len);
        vi = layer.v_cache.index_select(0, blocks[i]).flatten(0, 1).narrow(0, 0, context + len);
      }
      prompt_attention(attn.narrow(0, start, len), q.narrow(0, start, len), ki, vi, context, true, c10::nullopt);
    }
  }

  // x: the embedded tokens [T, H] (its rows become the residual stream); returns the final norm's output.
  // rows, block_table ... decode_amx: what the CPU backend passes the paged-attention kernel for this step.
  // prefix_blocks > 0: the rows share that many leading blocks (prefix_first_block, the first of them when they
  // are consecutive, else -1 and their ids in prefix_block_ids), attended by cascade() for the tokens in
  // token_index (all_tokens: every token of the step, in order). rows: none when the step is only prompt chunks,
  // which prompt_spans gives (see prompts()). out_rows: the step's tokens whose hidden states are used (int64,
  // ascending), or none for all: the last layer attends for every token (its K/V are in the cache already) but
  // runs its o-proj and MLP, and the final norm, for these rows alone, which are all it returns. In a prompt
  // step only the last token samples, and those two are ~85% of the layer's matmuls (llama.cpp skips them too).
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_table,
                     at::Tensor seq_lens, at::Tensor query_start_loc, c10::optional<at::Tensor> rows, bool decode_amx,
                     int64_t prefix_blocks, int64_t prefix_first_block, c10::optional<at::Tensor> prefix_block_ids,
                     c10::optional<at::Tensor> token_index, bool all_tokens, c10::optional<at::Tensor> prompt_spans,
                     c10::optional<at::Tensor> out_rows) {
    TORCH_CHECK(!layers.empty() && layers.back().linears.size() == 4, "decoder stack: incomplete");
    TORCH_CHECK(!out_rows.has_value() || (out_rows->scalar_type() == at::kLong && out_rows->dim() == 1 &&
                                          out_rows->size(0) > 0),
                "decoder stack: out_rows must be a non-empty 1-d int64 tensor");
    TORCH_CHECK(prefix_blocks == 0 || (rows.has_value() && token_index.has_value() &&
                                       (prefix_first_block >= 0 || prefix_block_ids.has_value())),
                "decoder stack: a shared prefix needs its rows, token index and blocks");
    const int64_t tokens = x.size(0);
    const std::vector<at::Tensor> blocks =
        prompt_spans.has_value() ? span_blocks(*prompt_spans, block_table) : std::vector<at::Tensor>();
    at::Tensor residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      const StackLayer& layer = layers[i];
      if (i == 0) {
        residual = x;
        x = at::empty_like(residual);
        tokenmill_native::rms_norm(x, residual, layer.input_norm, eps);
      } else {
        tokenmill_native::add_rms_norm(x, residual, layer.input_norm, eps);
      }
      at::Tensor qkv = layer.linears[0](x);
      at::Tensor q = at::empty({tokens, hq, head_dim}, qkv.options());
      tokenmill_native::rope_and_cache(q, qkv, positions, cos, sin, layer.k_cache, layer.v_cache, slot_mapping, hq,
                                       hkv, layer.k_scale, layer.v_scale, layer.k_offset);
      at::Tensor attn = at::empty_like(q);
      if (prefix_blocks > 0) {
        cascade(layer, attn, q, block_table, seq_lens, query_start_loc, *rows, decode_amx, prefix_blocks,
                prefix_first_block, prefix_block_ids, *token_index, all_tokens);
      } else if (rows.has_value()) {
        tokenmill_native::paged_attention(attn, q, layer.k_cache, layer.v_cache, block_table, seq_lens,
                                          query_start_loc, *rows, scale, 0, c10::nullopt, layer.k_scale, layer.v_scale,
                                          0, decode_amx);
      }
      if (prompt_spans.has_value()) prompts(layer, attn, q, qkv, *prompt_spans, blocks);
      at::Tensor heads = attn.view({tokens, hq * head_dim});
      if (out_rows.has_value() && i + 1 == layers.size() && out_rows->size(0) < tokens) {
        heads = heads.index_select(0, *out_rows);
        residual = residual.index_select(0, *out_rows);
      }
      x = layer.linears[1](heads);
      tokenmill_native::add_rms_norm(x, residual, layer.post_norm, eps);
      x = mlp(layer, x);
    }
    tokenmill_native::add_rms_norm(x, residual, final_norm, eps);
    return x;
  }
};

}  // namespace

TM_LIBRARY_FRAGMENT(m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_linear", &DecoderStack::add_linear)
      .def("forward", &DecoderStack::forward);
}

#endif
