"""Whisper's special tokens and decoding rules, read from the model folder (tokenizer.json's added tokens, and
generation_config.json or the CTranslate2 config.json's suppress lists), and the decoder prompt they make:

    [<|startofprev|> previous text ...] <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]

English-only models (a vocabulary under 51,865) take no language or task token. Timestamp tokens follow
<|notimestamps|>, one per 0.02 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SECONDS_PER_TIMESTAMP = 0.02
MAX_INITIAL_TIMESTAMP_INDEX = 50   # the first timestamp is at most 1.0 s (Whisper's and transformers' default)
MULTILINGUAL_VOCAB = 51865


@dataclass(frozen=True)
class WhisperTokens:
    sot: int
    eot: int
    no_timestamps: int
    transcribe: int | None
    translate: int | None
    start_of_prev: int | None
    languages: dict[str, int]           # "en" -> id of <|en|>
    multilingual: bool
    suppress: tuple[int, ...] = ()       # never sampled
    begin_suppress: tuple[int, ...] = ()  # not sampled first (a blank, or the end at once)
    vocab_size: int = 0

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def prompt(self, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
               previous: list[int] | None = None) -> list[int]:
        """The decoder prompt; a ValueError naming the field for what the model cannot do."""
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be transcribe or translate, got {task!r}")
        ids = []
        if previous:
            if self.start_of_prev is None:
                raise ValueError("prompt: the model has no <|startofprev|> token to carry a prompt")
            ids += [self.start_of_prev, *previous[-(223):]]   # (Whisper keeps the last half of its context)
        ids.append(self.sot)
        if self.multilingual:
            code = (language or "en").lower()
            if code not in self.languages:
                raise ValueError(f"language {language!r} is not one the model knows (ISO-639-1 codes such as en, "
                                 "de, fr)")
            ids += [self.languages[code], self.transcribe if task == "transcribe" else self.translate]
        else:
            if language not in (None, "", "en", "english"):
                raise ValueError(f"language: the model is English-only, it cannot take {language!r}")
            if task == "translate":
                raise ValueError("the model is English-only: it transcribes English, it cannot translate")
        if not timestamps:
            ids.append(self.no_timestamps)
        return ids


def whisper_tokens(folder: str | Path, hf_config) -> WhisperTokens:
    folder = Path(folder)
    tok = folder / "tokenizer.json"
    if not tok.is_file():
        raise ValueError(f"{folder} has no tokenizer.json: a Whisper model needs its tokenizer's special tokens")
    added = {t["content"]: int(t["id"]) for t in json.loads(tok.read_text()).get("added_tokens", [])}
    for name in ("<|startoftranscript|>", "<|endoftext|>", "<|notimestamps|>"):
        if name not in added:
            raise ValueError(f"{tok}: no {name} token: not a Whisper tokenizer")
    languages = {c[2:-2]: i for c, i in added.items()
                 if c.startswith("<|") and c.endswith("|>") and 2 <= len(c) - 4 <= 3 and c[2:-2].isalpha()
                 and c[2:-2].islower() and c not in ("<|nocaptions|>",)}
    suppress, begin = _suppress_lists(folder, hf_config)
    vocab = int(hf_config.vocab_size)
    return WhisperTokens(sot=added["<|startoftranscript|>"], eot=added["<|endoftext|>"],
                         no_timestamps=added["<|notimestamps|>"], transcribe=added.get("<|transcribe|>"),
                         translate=added.get("<|translate|>"), start_of_prev=added.get("<|startofprev|>"),
                         languages=languages, multilingual=vocab >= MULTILINGUAL_VOCAB,
                         suppress=tuple(suppress), begin_suppress=tuple(begin), vocab_size=vocab)


def _suppress_lists(folder: Path, hf_config) -> tuple[list[int], list[int]]:
    gen = folder / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        if "suppress_tokens" in g or "begin_suppress_tokens" in g:
            return list(g.get("suppress_tokens") or []), list(g.get("begin_suppress_tokens") or [])
    return (list(getattr(hf_config, "suppress_tokens", None) or []),
            list(getattr(hf_config, "begin_suppress_tokens", None) or []))
