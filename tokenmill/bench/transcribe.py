"""`tokenmill bench transcribe`: real speech clips (espeak-ng at several speeds, one over 30 s) sent to an
OpenAI-compatible /v1/audio/transcriptions, scored by word error rate against the texts spoken and against
faster-whisper's greedy transcript of the same clips, with the wall time of concurrent uploads against
faster-whisper run one clip after another, and the real-time factor."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

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


# Shipped texts: short sentences, and one paragraph that runs past 30 s when spoken (two windows).
TEXTS = [
    "The weather today is sunny with a light breeze from the west.",
    "Please send the quarterly report to the finance team before Friday.",
    "A small engine that reads like a teaching project can still serve real models.",
    "The train to the airport leaves every twenty minutes from platform four.",
    ("The committee met on Monday morning to discuss the new library. The architect showed drawings of a bright "
     "reading room with tall windows facing the river. Several members asked about the cost of heating such a "
     "large space in winter. The treasurer said the budget would allow solar panels on the roof. After a long "
     "debate the committee agreed to build the library next spring. Everyone thanked the architect for her "
     "careful work and the meeting ended at noon."),
]


@dataclass
class Clip:
    name: str
    text: str
    path: Path
    seconds: float


def make_clips(folder: Path, speeds: list[int]) -> list[Clip]:
    """Each text spoken by espeak-ng at each speed (words a minute), as 16 kHz mono WAV (sox)."""
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for speed in speeds:
        for i, text in enumerate(TEXTS):
            path = folder / f"text{i}_s{speed}.wav"
            if not path.exists():
                raw = path.with_suffix(".raw.wav")
                subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(raw), text], check=True, capture_output=True)
                subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", str(path)], check=True, capture_output=True)
                raw.unlink()
            clips.append(Clip(path.stem, text, path, sf.info(str(path)).duration))
    return clips


def transcribe_server(base_url: str, model: str, clip: Clip) -> str:
    import requests

    with open(clip.path, "rb") as f:
        r = requests.post(base_url + "/v1/audio/transcriptions", files={"file": (clip.path.name, f, "audio/wav")},
                          data={"model": model, "temperature": "0"}, timeout=600)
    r.raise_for_status()
    return r.json()["text"]


def run_transcribe_bench(args: argparse.Namespace) -> int:
    import requests

    clips = make_clips(Path(args.clips_dir), [int(s) for s in args.speeds.split(",")])
    model = args.model or requests.get(args.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    audio_seconds = sum(c.seconds for c in clips)
    print(f"{len(clips)} clips, {audio_seconds:.1f} s of speech (longest {max(c.seconds for c in clips):.1f} s)")
    transcribe_server(args.base_url, model, clips[0])   # (warm)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        ours = list(pool.map(lambda c: transcribe_server(args.base_url, model, c), clips))
    wall = time.perf_counter() - t0
    result = {"label": args.label, "clips": len(clips), "audio_seconds": round(audio_seconds, 2),
              "concurrency": args.concurrency, "wall_s": round(wall, 3), "rtf": round(wall / audio_seconds, 4),
              "wer": round(_corpus_wer([c.text for c in clips], ours), 4), "per_clip": []}
    refs = None
    if args.faster_whisper_model:
        refs, fw_wall = _faster_whisper(args.faster_whisper_model, args.compute_type, clips)
        result.update(faster_whisper_wall_s=round(fw_wall, 3), faster_whisper_rtf=round(fw_wall / audio_seconds, 4),
                      faster_whisper_wer=round(_corpus_wer([c.text for c in clips], refs), 4),
                      wall_ratio=round(wall / fw_wall, 3), wer_vs_faster_whisper=round(_corpus_wer(refs, ours), 4))
    for i, (c, said) in enumerate(zip(clips, ours)):
        row = {"clip": c.name, "seconds": round(c.seconds, 2), "wer": round(word_error_rate(c.text, said), 3),
               "text": said.strip()}
        if refs is not None:
            row.update(faster_whisper=refs[i].strip(), words_apart=word_errors(refs[i], said)[0])
        result["per_clip"].append(row)
    _print(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def _faster_whisper(folder: str, compute_type: str, clips: list[Clip]) -> tuple[list[str], float]:
    """faster-whisper's greedy transcripts (beam 1, temperature 0, no timestamps), one clip after another."""
    from faster_whisper import WhisperModel

    model = WhisperModel(folder, device="cpu", compute_type=compute_type, cpu_threads=os.cpu_count() or 2)

    def one(c: Clip) -> str:
        segments, _ = model.transcribe(str(c.path), beam_size=1, temperature=0.0, without_timestamps=True,
                                       condition_on_previous_text=False, vad_filter=False)
        return " ".join(s.text.strip() for s in segments)

    one(clips[0])   # (warm)
    t0 = time.perf_counter()
    texts = [one(c) for c in clips]
    return texts, time.perf_counter() - t0


def _corpus_wer(truths: list[str], said: list[str]) -> float:
    errors = [word_errors(t, s) for t, s in zip(truths, said)]
    return sum(e for e, _ in errors) / max(1, sum(n for _, n in errors))


def _print(r: dict) -> None:
    print(f"tokenmill: {r['concurrency']} concurrent uploads, wall {r['wall_s']:.2f} s, RTF {r['rtf']:.3f}, "
          f"WER {r['wer']:.3f}")
    if "faster_whisper_wall_s" in r:
        print(f"faster-whisper (sequential): wall {r['faster_whisper_wall_s']:.2f} s, "
              f"RTF {r['faster_whisper_rtf']:.3f}, "
              f"WER {r['faster_whisper_wer']:.3f}; wall ratio {r['wall_ratio']:.2f}x, WER between the two "
              f"{r['wer_vs_faster_whisper']:.3f}")
    for row in r["per_clip"]:
        apart = f", {row['words_apart']} words from faster-whisper" if "words_apart" in row else ""
        print(f"  {row['clip']:>14} {row['seconds']:5.1f} s  WER {row['wer']:.2f}{apart}: {row['text'][:90]}")


def add_transcribe_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The OpenAI-compatible server to test.")
    p.add_argument("--model", default=None, help="The model name to send (default: the server's first).")
    p.add_argument("--clips-dir", default="/tmp/tokenmill-speech-clips", help="Where the espeak-ng clips are made.")
    p.add_argument("--speeds", default="130,160,190", help="espeak-ng speeds, words a minute, comma-separated.")
    p.add_argument("--concurrency", type=int, default=4, help="Uploads in flight at once.")
    p.add_argument("--faster-whisper-model", default=None,
                   help="A CTranslate2 Whisper folder: faster-whisper transcribes the same clips one after another "
                        "(the reference for WER and wall time).")
    p.add_argument("--compute-type", default="float32", help="faster-whisper's compute type (float32, int8).")
    p.add_argument("--label", default="tokenmill")
    p.add_argument("--output-json", default=None)
