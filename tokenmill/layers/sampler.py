"""One batched sampler for the whole step: logit bias, min_tokens, penalties, temperature, top-k, top-p,
min-p and per-request seeds, with logprobs of the raw model output (as vLLM reports them).

A row draws by inverting its cumulative distribution with one uniform number, taken from the request's own
generator when it has a seed, so a seeded request's tokens do not depend on the batch. (The exponential race
used before needed a random number per vocabulary entry: 280 ms of a 128-row step here, the inversion ~15 ms.)
Top-p keeps to the rows' best TOP_P_CANDIDATES tokens when they hold the mass, instead of sorting the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tokenmill.kernels as kernels
from tokenmill.structured_output.bitmask import apply_token_bitmask

_EPS = 1e-5
# top-p looks for its cut among each row's best this-many tokens (one topk, ~30 ms at 128 rows of SmolLM2's
# vocabulary, against ~470 ms to sort them); a row whose best ones hold less than top_p sorts its whole row.
TOP_P_CANDIDATES = 256


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor                    # [B] float32; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None            # [B] int64, 0 = off
    top_p: torch.Tensor | None = None            # [B] float32
    min_p: torch.Tensor | None = None            # [B] float32
    generators: dict[int, torch.Generator] | None = None  # row -> the request's own generator
    max_num_logprobs: int | None = None
    presence_penalty: torch.Tensor | None = None  # [B]; penalties are None when no row uses them
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    logit_bias: list[dict[int, float] | None] | None = None
    stop_token_mask: list[tuple[int, list[int]]] | None = None  # rows still under min_tokens: ids to forbid
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, packed allowed tokens): grammars


@dataclass
class SamplerOutput:
    sampled: torch.Tensor                                 # [B] int64
    logprob_token_ids: torch.Tensor | None = None         # [B, 1 + k]: the sampled token, then the top k
    logprobs: torch.Tensor | None = None                  # [B, 1 + k]
    sampled_ranks: torch.Tensor | None = None             # [B]


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None):
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: [B, vocab] in the model's dtype, the step's own (the greedy path writes min_tokens' -inf into
        them); fp32 is made only when something needs more than an argmax."""
        logits, raw_logprobs = self.prepare(logits, md)
        if md.all_greedy:
            sampled = greedy_tokens(logits)
        else:
            sampled = self._sample(logits, md)
            greedy_rows = md.temperature < _EPS
            if bool(greedy_rows.any()):   # (an argmax over the vocabulary only where a row needs one)
                sampled = torch.where(greedy_rows, greedy_tokens(logits), sampled)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs, out)
        return out

    def prepare(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits every row's choice is made from (bias, min_tokens, penalties applied), and the log-softmax of
        the raw logits when logprobs are asked. An all-greedy batch with nothing but min_tokens stays in the model's
        dtype (-inf is exact in bf16); anything else is fp32. A grammar's mask comes first, so logprobs (like
        vLLM's) are those of the constrained distribution."""
        if md.token_bitmask is not None:
            apply_token_bitmask(logits, *md.token_bitmask)
        if md.all_greedy and md.max_num_logprobs is None and md.logit_bias is None and md.repetition_penalty is None:
            if md.stop_token_mask:
                forbid_stop_tokens(logits, md.stop_token_mask, md.token_bitmask is not None)
            return logits, None
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        return self._apply_constraints(logits, md), raw_logprobs

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.logit_bias is not None:
            for row, bias in enumerate(md.logit_bias):
                if bias:
                    ids = torch.tensor(list(bias.keys()), device=logits.device)
                    logits[row, ids] += torch.tensor(list(bias.values()), device=logits.device)
        if md.stop_token_mask:
            forbid_stop_tokens(logits, md.stop_token_mask, md.token_bitmask is not None)
        if md.repetition_penalty is not None:
            logits = apply_penalties(logits, md)
        return logits

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if logits.is_cuda and md.top_k is None and md.top_p is None and md.min_p is None and _fused_on_gpu():
            from tokenmill.kernels.gpu.sampling import sample_with_temperature

            temp = torch.where(md.temperature < _EPS, torch.ones_like(md.temperature), md.temperature)
            return sample_with_temperature(logits, temp, self.uniforms(logits.shape[0], md.generators, logits.device))
        return self.draw(self.probs(logits, md), md.generators)

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, top-k, top-p, then min-p (unnormalised
        after min-p; the draw does not need a sum of one)."""
        temp = torch.where(md.temperature < _EPS, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temp[:, None]
        if md.top_k is not None:
            logits = apply_top_k(logits, md.top_k)
        if md.top_p is not None:
            logits = apply_top_p(logits, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            probs = probs.masked_fill(probs < md.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def uniforms(self, rows: int, generators: dict[int, torch.Generator] | None, device) -> torch.Tensor:
        """A row's u: from the request's own generator where it has a seed, else the engine's."""
        u = torch.rand(rows, generator=self.default_generator, device=device)
        for row, gen in (generators or {}).items():
            u[row] = torch.rand(1, generator=gen, device=device)[0]
        return u

    def draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
        """One draw per row from `probs` (any non-negative weights): the first token whose running sum passes
        u times the row's sum, u uniform in [0, 1), kept below the sum when rounding would reach it. A token of
        zero weight never passes (its running sum is the one before it)."""
        u = self.uniforms(probs.shape[0], generators, probs.device)
        cdf = probs.float().cumsum(dim=-1)
        total = cdf[:, -1:]
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def _fused_on_gpu() -> bool:
    """Temperature-only rows on a GPU draw in one Triton kernel (kernels/gpu/sampling.py) where Triton is."""
    from tokenmill.kernels import gpu

    return gpu.available("cuda")


def forbid_stop_tokens(logits: torch.Tensor, stop_token_mask: list[tuple[int, list[int]]],
                       grammar_first: bool = False) -> None:
    """-inf at each (row, stop id) of the rows still under min_tokens, in one indexed write (a write per row
    cost ~1 ms a step at 128 rows). With grammars, a finished grammar allows only EOS: there min_tokens yields,
    rather than leave a row with nothing to choose."""
    rows = [row for row, ids in stop_token_mask for _ in ids]
    cols = [i for _, ids in stop_token_mask for i in ids]
    dev = logits.device
    under = torch.tensor([row for row, _ in stop_token_mask], device=dev)
    saved = logits[under] if grammar_first else None
    logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
    if saved is not None:
        empty = torch.isneginf(logits[under]).all(dim=-1)
        if bool(empty.any()):
            logits[under[empty]] = saved[empty]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum. bf16 logits go to the native kernel: converting [B, vocab] to fp32 and
    reducing it cost ~10 ms per step at B=128 here, the kernel well under 1 ms."""
    if kernels.native_kernels_for(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return kernels.ops().argmax_rows(logits)
    return logits.max(dim=-1).indices  # first maximum on ties; 3x faster than argmax on CPU


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k best tokens (and any tied with the last); rows with top_k 0 keep all (they do not
    make the others' topk as wide as the vocabulary)."""
    on = (top_k > 0) & (top_k < logits.shape[-1])
    if not bool(on.any()):
        return logits
    k = torch.where(on, top_k, torch.ones_like(top_k))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill((logits < kth) & on[:, None], float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's most likely tokens until their mass reaches top_p (the token that crosses it included):
    found among the row's best TOP_P_CANDIDATES (their probabilities against the whole row's log-sum-exp), or,
    for rows whose best ones hold less, by sorting the row. Tokens tied with the last one kept are kept too."""
    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    best = logits.topk(k, dim=-1).values                                  # [B, k], descending
    p = torch.exp(best - torch.logsumexp(logits, dim=-1, keepdim=True))
    cum = p.cumsum(dim=-1)
    kept = ((cum - p) <= top_p[:, None]).sum(dim=-1).clamp(min=1)        # tokens before the mass reaches top_p
    cut = best.gather(1, (kept - 1)[:, None])
    on = top_p < 1.0                                                      # rows of 1.0 keep every token
    short = on & (cum[:, -1] < top_p) & (kept == k)                       # top_p needs more than the candidates
    if bool(short.any()):
        rows = torch.nonzero(short)[:, 0]
        cut[rows] = _sorted_top_p_cut(logits[rows], top_p[rows])
    return logits.masked_fill((logits < cut) & on[:, None], float("-inf"))


def _sorted_top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The same cut as apply_top_p's, from a full sort of each row: [B, 1], the last kept logit."""
    ordered = logits.sort(dim=-1, descending=True).values
    p = ordered.softmax(dim=-1)
    kept = ((p.cumsum(dim=-1) - p) <= top_p[:, None]).sum(dim=-1).clamp(min=1)
    return ordered.gather(1, (kept - 1)[:, None])


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    b, vocab = logits.shape
    dev = logits.device
    out_counts = torch.zeros(b, vocab + 1, device=dev)
    for row, ids in enumerate(md.output_token_ids or []):
        if ids:
            out_counts[row].index_add_(0, torch.tensor(ids, device=dev), torch.ones(len(ids), device=dev))
    out_counts = out_counts[:, :vocab]
    seen = out_counts > 0
    for row, ids in enumerate(md.prompt_token_ids or []):
        if ids:
            seen[row, torch.tensor(ids, device=dev)] = True
    rep = md.repetition_penalty[:, None].expand(b, vocab)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty[:, None] * out_counts
    return logits - md.presence_penalty[:, None] * (out_counts > 0).float()


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int, out: SamplerOutput) -> None:
    """Row i: the chosen token's logprob first, then the top k; plus the chosen token's rank (1 = best)."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ids, lps = [chosen[:, None]], [chosen_lp]
    if k > 0:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids.append(top.indices)
        lps.append(top.values)
    out.logprob_token_ids = torch.cat(ids, dim=1)
    out.logprobs = torch.cat(lps, dim=1)
    out.sampled_ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
