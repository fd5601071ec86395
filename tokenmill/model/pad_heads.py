"""A copy of a Llama-family model with zero-weight attention heads added, so that a tensor-parallel size
divides its heads: SmolLM2-135M has 9 query and 3 KV heads, which 2 does not divide; padded to 16 and 4 it
computes the same outputs (a padded query head reads nothing the output projection keeps; a padded KV head is
read only by padded query heads).

    python -m tokenmill.model.pad_heads OUT [--model PATH] [--heads 16] [--kv-heads 4]

Used by the tensor-parallel tests and benchmarks on real weights; writes fp32 safetensors, config and tokenizer.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch


def pad_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, heads: int, kv_heads: int,
                  new_heads: int, new_kv_heads: int, head_dim: int):
    """q/k/v [heads * head_dim, hidden] and o [hidden, heads * head_dim] with query head g * group + i (group
    = heads // kv_heads) moved to g * new_group + i, and zero rows (columns of o) everywhere else."""
    group, new_group = heads // kv_heads, new_heads // new_kv_heads
    if new_kv_heads < kv_heads or new_group < group:
        raise ValueError(f"cannot pad {heads}/{kv_heads} heads to {new_heads}/{new_kv_heads}")
    hidden = q.shape[1]
    q2 = q.new_zeros(new_heads * head_dim, hidden)
    o2 = o.new_zeros(o.shape[0], new_heads * head_dim)
    for h in range(heads):
        g, i = divmod(h, group)
        dst = (g * new_group + i) * head_dim
        q2[dst:dst + head_dim] = q[h * head_dim:(h + 1) * head_dim]
        o2[:, dst:dst + head_dim] = o[:, h * head_dim:(h + 1) * head_dim]
    pad_kv = (new_kv_heads - kv_heads) * head_dim
    k2 = torch.cat([k, k.new_zeros(pad_kv, hidden)])
    v2 = torch.cat([v, v.new_zeros(pad_kv, hidden)])
    return q2, k2, v2, o2


def write_padded_model(out: str | Path, model: str | None = None, heads: int = 16, kv_heads: int = 4) -> Path:
    from safetensors.torch import save_file

    from tokenmill.model.loader import iter_safetensors
    from tokenmill.model.model_config import head_dim_of, load_hf_config
    from tokenmill.model.source import resolve_model
    from tokenmill.model.tokenizer import load_tokenizer

    source = resolve_model(model)
    cfg = load_hf_config(source.path, source.format)
    if source.format == "gguf":
        from tokenmill.model.gguf_file import iter_gguf_weights

        weights = dict(iter_gguf_weights(source.path, cfg))
    else:
        weights = dict(iter_safetensors(source.path))
    head_dim = head_dim_of(cfg)
    for prefix in sorted({n.rsplit(".self_attn.", 1)[0] for n in weights if ".self_attn.q_proj.weight" in n}):
        names = [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"]
        if any(f"{prefix}.self_attn.{p}_proj.bias" in weights for p in "qkv"):
            raise ValueError("padding heads of a model with q/k/v biases is not supported")
        padded = pad_attention(*(weights[n].float() for n in names), cfg.num_attention_heads,
                               cfg.num_key_value_heads, heads, kv_heads, head_dim)
        weights.update(zip(names, padded))
    from tokenmill.model.gguf_config import typed_hf_config

    new_cfg = copy.deepcopy(typed_hf_config(cfg))
    new_cfg.num_attention_heads, new_cfg.num_key_value_heads, new_cfg.head_dim = heads, kv_heads, head_dim
    new_cfg.architectures = ["LlamaForCausalLM"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    new_cfg.save_pretrained(out)
    tied = getattr(cfg, "tie_word_embeddings", False)
    save_file({n: t.float().contiguous() for n, t in weights.items() if not (tied and n == "lm_head.weight")},
              str(out / "model.safetensors"))
    load_tokenizer(source.path).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ns = ap.parse_args()
    print(write_padded_model(ns.out, ns.model, ns.heads, ns.kv_heads))


if __name__ == "__main__":
    main()
