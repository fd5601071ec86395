"""A decoder's sizes from its Hugging Face config, and the bytes and flops they imply: weights as tokenmill keeps
them for each --quantization (the kernels' own layouts), KV bytes per token, flops per prompt and decoded token."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import KV_CACHE_DTYPES

_BLOCK = 16          # output rows per block of the native quantized kernels
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    num_experts: int = 0           # routed experts (MoE); 0 for a dense MLP
    experts_per_token: int = 0

    @classmethod
    def from_hf_config(cls, hf) -> ModelShape:
        heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        experts = int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)
        inter = int(getattr(hf, "moe_intermediate_size", 0) or hf.intermediate_size) if experts else \
            int(hf.intermediate_size)
        return cls(int(hf.num_hidden_layers), int(hf.hidden_size), inter, heads,
                   int(getattr(hf, "num_key_value_heads", heads)), head_dim, int(hf.vocab_size),
                   bool(getattr(hf, "tie_word_embeddings", False)), experts,
                   int(getattr(hf, "num_experts_per_tok", 0) or 0))

    def without_lm_head(self) -> ModelShape:
        """The same layers with a zero-width vocabulary: what is left of the bytes once the lm head is gone."""
        from dataclasses import replace

        return replace(self, vocab_size=0)

    def layer_linears(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's matmuls: q, k, v, o and the MLP's gate, up, down (per expert for MoE)."""
        h, hd = self.hidden_size, self.head_dim
        attn = [(self.num_heads * hd, h), (self.num_kv_heads * hd, h), (self.num_kv_heads * hd, h),
                (h, self.num_heads * hd)]
        mlp = [(self.intermediate_size, h), (self.intermediate_size, h), (h, self.intermediate_size)]
        return attn + mlp * max(1, self.num_experts)

    def linear_params(self, per_token: bool = False) -> int:
        """Every layer's matmul weights (no lm head); per_token: those one token multiplies (its experts only)."""
        attn, mlp = self.layer_linears()[:4], self.layer_linears()[4:7]
        experts = self.experts_per_token if per_token and self.num_experts else max(1, self.num_experts)
        return self.num_layers * (sum(o * i for o, i in attn) + experts * sum(o * i for o, i in mlp))

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype: str, cache_dtype: str = "auto") -> int:
        itemsize = KV_CACHE_DTYPES.get(cache_dtype) or _ITEMSIZE[dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def flops_per_decoded_token(self, context: int) -> float:
        """Matmuls (2 per weight a token uses, the lm head included) plus attention over `context` tokens."""
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * context
        return 2.0 * (self.linear_params(per_token=True) + self.lm_head_params()) + attn

    def prefill_flops(self, prompt_len: int) -> float:
        """A prompt's matmuls, causal attention (half the square), and the lm head for its last token only."""
        attn = 2 * self.num_layers * self.num_heads * self.head_dim * prompt_len * prompt_len
        return 2.0 * self.linear_params(per_token=True) * prompt_len + attn + 2.0 * self.lm_head_params()


def linear_bytes(out: int, inp: int, dtype: str, quantization: str | None, group_size: int = 32) -> int:
    """What tokenmill keeps of one matmul weight, as its kernel stores it (and one decode step reads): the model
    dtype; int8 as bytes with an fp16 scale per output; int4 as nibbles with an fp16 scale and minimum per group.
    The native kernels take bf16 models with outputs in blocks of 16 and groups of 32k; elsewhere the quantized
    weight is kept dequantized in the model dtype."""
    itemsize = _ITEMSIZE[dtype]
    group = inp if quantization == "int8" else group_size
    native = dtype == "bfloat16" and out % _BLOCK == 0 and group % 32 == 0 and inp % group == 0
    if quantization not in ("int8", "int4") or not native:
        return out * inp * itemsize
    if quantization == "int8":
        return out * inp + out * 2
    return out * inp // 2 + 2 * out * (inp // group) * 2


def decode_weight_bytes(shape: ModelShape, dtype: str, quantization: str | None, group_size: int = 32) -> int:
    """Bytes of the weights one decode step streams: every layer's matmuls and the lm head (int8 under int4)."""
    per_layer = sum(linear_bytes(o, i, dtype, quantization, group_size) for o, i in shape.layer_linears())
    head_quant = "int8" if quantization == "int4" else quantization
    return shape.num_layers * per_layer + linear_bytes(shape.vocab_size, shape.hidden_size, dtype, head_quant)


def resident_weight_bytes(shape: ModelShape, dtype: str, quantization: str | None, group_size: int = 32) -> int:
    """Everything the weights take in memory: the streamed matmuls plus the embedding table (kept in the model
    dtype for lookups, beside the lm head's copy) and the norms."""
    itemsize = _ITEMSIZE[dtype]
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * itemsize
    return decode_weight_bytes(shape, dtype, quantization, group_size) + shape.lm_head_params() * itemsize + norms
