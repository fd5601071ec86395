"""`tokenmill bench transcribe`: real speech clips (espeak-ng at several speeds, one over 30 s) sent to an
OpenAI-compatible /v1/audio/transcriptions, scored by word error rate against the texts spoken and against
faster-whisper's greedy transcript of the same clips, with the wall time of concurrent uploads against
faster-whisper run one clip after another, and the real-time factor."""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9']+")


def normalize(text: str) -> list[str]:
    """Lowercase words without punctuation (the usual normalisation before a WER)."""
    return _WORD.findall(text.lower().replace("-", " "))


def word_errors(truth: str, said: str) -> tuple[int, int]:
    """(substitutions + insertions + deletions, words in truth): a word-level Levenshtein distance."""
    a, b = normalize(truth), normalize(said)
    prev = list(range(len(b) + 1))
    for i, wa in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, wb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (wa != wb))
        prev = cur
    return prev[-1], len(a)


def word_error_rate(truth: str, said: str) -> float:
    errors, words = word_errors(truth, said)
    return errors / max(words, 1)
