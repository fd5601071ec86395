"""Picks the proposer for `speculative_config.method`; the proposer modules import only the seam's base classes,
so the choice lives here and none of them imports another."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.spec_decode.proposer import NgramProposer, Proposer


def make_proposer(config: EngineConfig, backend, device: str, target: torch.nn.Module) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method in ("eagle", "eagle3"):
        from tokenmill.spec_decode.eagle import EagleProposer

        return EagleProposer(config, backend, device, target)
    from tokenmill.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, backend, device)
