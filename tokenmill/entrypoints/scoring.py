"""What /v1/score, /v1/rerank and LLM.score share: how texts pair up, how a pair becomes one prompt for a
cross-encoder, and how a score comes out of a cross-encoder's logits or two embeddings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair, as vLLM's."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against one or many, or two lists of the same length pairwise."""
    one = [text_1] if isinstance(text_1, str) else list(text_1)
    two = [text_2] if isinstance(text_2, str) else list(text_2)
    if not one or not two:
        raise ValueError("text_1 and text_2 must not be empty")
    if not all(isinstance(t, str) for t in one + two):
        raise ValueError("text_1 and text_2 must be strings or lists of strings")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise ValueError(f"text_1 and text_2 must be one text and a list, or lists of the same length; got "
                         f"{len(one)} and {len(two)}")
    return list(zip(one, two))


def pair_token_ids(tokenizer, query: str, document: str) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding (its special tokens between and around)."""
    return list(tokenizer(query, document)["input_ids"])


def cross_encoder_score(logits: Sequence[float]) -> float:
    """sentence-transformers' and vLLM's score for a one-label cross-encoder: the sigmoid of its logit."""
    if len(logits) != 1:
        raise ValueError(f"score needs a cross-encoder with one label; this model has {len(logits)}")
    return 1.0 / (1.0 + math.exp(-float(logits[0])))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
