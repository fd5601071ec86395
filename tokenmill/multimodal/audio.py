"""Audio for speech models: decode an upload (soundfile: wav, flac, ogg, mp3), resample to 16 kHz (soxr),
cut long audio into windows of at most 30 s at its quietest moments, and compute Whisper's log-mel frames.

The log-mel front end follows Whisper's (and transformers' WhisperFeatureExtractor): a 400-sample periodic Hann
window every 160 samples over the window padded to 30 s, the power spectrum through a Slaney-style mel filter
bank (80 or 128 bins up to 8 kHz), log10, a floor 8 below the window's peak, then (x + 4) / 4. numpy only: the API
process never imports torch.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE
MIN_CUT_SECONDS = 20   # a long clip's window ends at its quietest 0.1 s between 20 and 30 s


def decode_audio(data: bytes, what: str = "file") -> np.ndarray:
    """Mono float32 samples at 16 kHz from an encoded file; a ValueError naming `what` when it cannot be read."""
    import soundfile as sf

    if not data:
        raise ValueError(f"{what} is empty")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - libsndfile's errors are the upload's fault
        raise ValueError(f"{what} could not be decoded as audio (wav, flac, ogg or mp3): {e}") from e
    if samples.size == 0:
        raise ValueError(f"{what} holds no audio samples")
    return resample(samples.mean(axis=1), rate)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if rate == SAMPLE_RATE:
        return samples
    if rate <= 0:
        raise ValueError(f"the audio's sample rate must be positive, got {rate}")
    import soxr

    return soxr.resample(samples, rate, SAMPLE_RATE).astype(np.float32)


def checked_audio(item, max_seconds: float, what: str = "audio") -> np.ndarray:
    """vLLM's audio item: (samples, sample rate), or samples already at 16 kHz, as 16 kHz float32."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and np.isscalar(item[1]):
        samples, rate = item
    else:
        samples, rate = item, SAMPLE_RATE
    try:
        samples = np.asarray(samples, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be an array of samples or (samples, sample_rate): {e}") from e
    if samples.ndim == 2:   # (channels last or first): mixed down
        samples = samples.mean(axis=int(np.argmin(samples.shape)))
    if samples.ndim != 1 or samples.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array of samples")
    if not np.isfinite(samples).all():
        raise ValueError(f"{what} has NaN or infinite samples")
    samples = resample(samples, int(rate))
    check_duration(samples, max_seconds, what)
    return samples


def check_duration(samples: np.ndarray, max_seconds: float, what: str) -> None:
    seconds = len(samples) / SAMPLE_RATE
    if seconds > max_seconds:
        raise ValueError(f"{what} is {seconds:.1f} s long, over the limit of {max_seconds:g} s (--max-audio-clip-s)")


@dataclass(frozen=True)
class AudioWindow:
    start: int   # samples from the clip's start
    end: int

    @property
    def offset_seconds(self) -> float:
        return self.start / SAMPLE_RATE


def split_windows(samples: np.ndarray) -> list[AudioWindow]:
    """Windows of at most 30 s covering the clip: each ends at the quietest 0.1 s of its last 10 s, so a cut
    falls in a pause rather than inside a word where there is one."""
    n, start, out = len(samples), 0, []
    frame = SAMPLE_RATE // 10
    while n - start > WINDOW_SAMPLES:
        lo, hi = start + MIN_CUT_SECONDS * SAMPLE_RATE, start + WINDOW_SAMPLES
        energy = np.square(samples[lo:hi]).reshape(-1, frame).sum(axis=1)
        end = lo + int(np.argmin(energy)) * frame + frame // 2
        out.append(AudioWindow(start, end))
        start = end
    out.append(AudioWindow(start, n))
    return out


def mel_filters(n_mels: int, sampling_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters on the Slaney mel scale (linear below 1 kHz, logarithmic
    above), each normalised to unit area (Slaney's norm), from 0 Hz to 8 kHz."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 /
                        np.log(6.4))

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0))

    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return filters.T


_FILTERS: dict[int, np.ndarray] = {}


def log_mel(samples: np.ndarray, n_mels: int) -> np.ndarray:
    """[n_mels, 3000] float32 log-mel frames of one window (at most 30 s of 16 kHz samples, zero-padded)."""
    if len(samples) > WINDOW_SAMPLES:
        raise ValueError(f"a window holds at most {WINDOW_SECONDS} s of audio, got {len(samples) / SAMPLE_RATE:.1f} s")
    audio = np.zeros(WINDOW_SAMPLES, dtype=np.float64)
    audio[:len(samples)] = samples
    padded = np.pad(audio, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    window = np.hanning(N_FFT + 1)[:-1]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2          # [frames, bins]
    if n_mels not in _FILTERS:
        _FILTERS[n_mels] = mel_filters(n_mels)
    mel = _FILTERS[n_mels] @ power.T                                    # [n_mels, frames]
    spec = np.log10(np.maximum(mel, 1e-10))[:, :-1]
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


def silence_feature(n_mels: int, frames: int):
    """An audio item of silence (the engine's warm-up)."""
    from tokenmill.multimodal.inputs import MultiModalFeature, TensorData

    mel = np.full((n_mels, frames), -1.5, dtype=np.float32)
    return MultiModalFeature("audio", "0" * 32, 0, 1, {"input_features": TensorData.from_numpy(mel)})
