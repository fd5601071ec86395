"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

A router picks each token's top-k experts (softmax in fp32, then renormalised where the family does); the
experts' weights are stacked into two tensors, and tokens are grouped by expert so that each expert runs one
matmul over all of its tokens. Tensor parallel splits every expert's intermediate size over the ranks;
expert parallel instead gives each rank whole experts. Either way a rank's output is a partial sum, reduced over
the group once, after the shared expert has added its own part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import num_experts_of
from tokenmill.distributed.comm import tp_all_reduce
from tokenmill.distributed.parallel_state import expert_parallel_enabled, get_tp
from tokenmill.layers.linear import Linear, split_size
from tokenmill.model.llama_mlp import LlamaMLP

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
# checkpoint projection -> (stacked tensor, part): gate and up stack into w13, down is w2
_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0),
          "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}   # Mixtral's names


def moe_block_for(cfg, index: int) -> SparseMoeBlock | None:
    """The MoE MLP of layer `index`, or None where the layer is dense (Qwen2-MoE's mlp_only_layers and
    decoder_sparse_step)."""
    experts = num_experts_of(cfg)
    if not experts or index in (getattr(cfg, "mlp_only_layers", None) or []):
        return None
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    if (index + 1) % step:
        return None
    return SparseMoeBlock(cfg)


class FusedExperts(nn.Module):
    """w13 [experts, 2 * inter, hidden] (gate over up) and w2 [experts, hidden, inter], this rank's share."""

    def __init__(self, num_experts: int, hidden: int, inter: int, expert_parallel: bool):
        super().__init__()
        tp = get_tp()
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            local = split_size(num_experts, tp.size, "the experts")
            self.first_expert, self.tp_rank = tp.rank * local, 0
        else:
            local, self.first_expert, self.tp_rank = num_experts, 0, tp.rank
            inter = split_size(inter, tp.size, "the experts' intermediate size")
        self.num_local, self.inter = local, inter
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter), requires_grad=False)
        self.loaded: set[tuple[int, str, int]] = set()

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """One expert's gate, up or down projection from the checkpoint (skipped if another rank holds it)."""
        which, part = _PARTS[proj]
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return
        i = self.inter
        if which == "w13":
            rows = tensor[self.tp_rank * i:(self.tp_rank + 1) * i]
            self.w13.data[local, part * i:(part + 1) * i].copy_(rows)
        else:
            self.w2.data[local].copy_(tensor[:, self.tp_rank * i:(self.tp_rank + 1) * i])
        self.loaded.add((local, which, part))

    def check_loaded(self, name: str) -> None:
        missing = self.num_local * 3 - len(self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {missing} expert projection(s) of {name}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one gate/up matmul, silu-and-mul and down matmul per expert over its tokens;
        each weighted by its routing weight and added into the token's row."""
        flat = ids.flatten() - self.first_expert   # under expert parallel, other ranks' experts fall outside
        order = torch.argsort(flat, stable=True)
        experts = torch.arange(self.num_local + 1, dtype=flat.dtype, device=flat.device)
        bounds = torch.searchsorted(flat[order], experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            start, end = bounds[e], bounds[e + 1]
            if start == end:
                continue
            rows = token_of[start:end]
            gate, up = F.linear(x[rows], self.w13[e]).split(self.inter, dim=-1)
            out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.w2[e]) * weight_of[start:end, None])
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        hidden = cfg.hidden_size
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.gate = Linear(hidden, num_experts_of(cfg))   # the router, whole on every rank
        self.experts = FusedExperts(num_experts_of(cfg), hidden, inter, expert_parallel_enabled())
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = LlamaMLP(cfg, shared) if shared else None
        if self.shared_expert is not None:   # its partial sum joins the block's single all-reduce
            self.shared_expert.down_proj.reduce = False
        self.shared_expert_gate = Linear(hidden, 1) if shared else None

    def process_weights_after_loading(self) -> None:
        self.experts.check_loaded("a mixture-of-experts layer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tp_all_reduce(out)


def route_expert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert tensors go straight to their layer's stacked experts; the rest pass on to the common loader."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is None:
            yield name, tensor
            continue
        experts = modules.get(m.group(1) + ".experts")
        if not isinstance(experts, FusedExperts):
            raise ValueError(f"checkpoint tensor {name!r} has no matching mixture-of-experts layer")
        experts.load_expert(int(m.group(2)), m.group(3), tensor.to(experts.w13.dtype))
