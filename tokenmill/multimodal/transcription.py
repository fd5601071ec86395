"""Transcription as the front end sees it: a clip's options checked, the clip cut into windows of at most 30 s
(each one engine request, so a long clip's windows are decoded together in the same batches), and each window's
tokens turned back into timed segments, joined over the clip with each window's offset, and rendered in
OpenAI's response formats (json, text, verbose_json, srt, vtt)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.multimodal.audio import SAMPLE_RATE, AudioWindow, split_windows
from tokenmill.multimodal.whisper_tokens import SECONDS_PER_TIMESTAMP, WhisperTokens

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
                  "pt": "portuguese", "nl": "dutch", "ja": "japanese", "zh": "chinese", "ru": "russian"}


@dataclass(frozen=True)
class TranscriptionOptions:
    task: str = "transcribe"            # or "translate" (to English)
    language: str | None = None         # ISO-639-1; None: English on an English-only model, else "en"
    prompt: str | None = None           # text the model continues from (names, spelling)
    temperature: float = 0.0
    response_format: str = "json"

    def check(self) -> None:
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got "
                             f"{self.response_format!r}")
        if not 0.0 <= self.temperature <= 1.0:
            raise ValueError(f"temperature must be between 0 and 1, got {self.temperature}")

    @property
    def timestamps(self) -> bool:
        """Segments with times are asked for: the model decodes its timestamp tokens."""
        return self.response_format in ("verbose_json", "srt", "vtt")


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)


@dataclass
class Transcript:
    text: str
    language: str
    duration: float
    task: str
    segments: list[Segment]


def window_prompts(samples: np.ndarray, tokens: WhisperTokens, tokenizer,
                   opts: TranscriptionOptions) -> list[tuple[AudioWindow, list[int]]]:
    """Each window of the clip and its decoder prompt (the same for all: the user's prompt, language, task)."""
    previous = tokenizer(" " + opts.prompt.strip(), add_special_tokens=False).input_ids if opts.prompt else None
    prompt = tokens.prompt(opts.language, opts.task, opts.timestamps, previous)
    return [(w, prompt) for w in split_windows(samples)]


def window_segments(token_ids: list[int], window: AudioWindow, tokens: WhisperTokens, decode) -> list[Segment]:
    """A window's tokens as segments: text between a pair of timestamps is one segment at those times (plus the
    window's offset); text with no timestamps is one segment over the whole window."""
    ts, offset = tokens.timestamp_begin, window.offset_seconds
    span = (window.end - window.start) / SAMPLE_RATE
    ids = [t for t in token_ids if t != tokens.eot]
    segments: list[Segment] = []
    start = 0.0   # where the text being gathered began: the last timestamp before it
    text: list[int] = []
    for t in ids:
        if t < ts:
            text.append(t)
            continue
        time = (t - ts) * SECONDS_PER_TIMESTAMP
        if text:   # a timestamp after text closes its segment
            segments.append(Segment(0, offset + start, offset + min(time, span), decode(text).strip(), text))
            text = []
        start = time
    if text:   # text after the last timestamp (or with none at all): it runs to the window's end
        segments.append(Segment(0, offset + start, offset + span, decode(text).strip(), text))
    return [s for s in segments if s.text]


def join(windows: list[list[Segment]], duration: float, opts: TranscriptionOptions,
         tokens: WhisperTokens) -> Transcript:
    segments = [s for w in windows for s in w]
    for i, s in enumerate(segments):
        s.id = i
    language = "en" if not tokens.multilingual else (opts.language or "en").lower()
    return Transcript(" ".join(s.text for s in segments), LANGUAGE_NAMES.get(language, language), duration,
                      opts.task, segments)


def render(t: Transcript, fmt: str) -> dict | str:
    if fmt == "json":
        return {"text": t.text}
    if fmt == "text":
        return t.text + "\n"
    if fmt == "verbose_json":
        return {"task": t.task, "language": t.language, "duration": round(t.duration, 3), "text": t.text,
                "segments": [{"id": s.id, "seek": 0, "start": round(s.start, 2), "end": round(s.end, 2),
                              "text": s.text, "tokens": s.tokens, "temperature": 0.0} for s in t.segments]}
    stamp = _srt_time if fmt == "srt" else _vtt_time
    blocks = [f"{s.id + 1}\n{stamp(s.start)} --> {stamp(s.end)}\n{s.text}\n" if fmt == "srt" else
              f"{stamp(s.start)} --> {stamp(s.end)}\n{s.text}\n" for s in t.segments]
    return "\n".join(blocks) if fmt == "srt" else "WEBVTT\n\n" + "\n".join(blocks)


def _hms(seconds: float) -> tuple[int, int, int, int]:
    ms = int(round(seconds * 1000))
    return ms // 3_600_000, ms // 60_000 % 60, ms // 1000 % 60, ms % 1000


def _srt_time(seconds: float) -> str:
    h, m, s, ms = _hms(seconds)
    return f"{h:02d}:{m:02d}:{s:02d},{ms:03d}"


def _vtt_time(seconds: float) -> str:
    h, m, s, ms = _hms(seconds)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"
