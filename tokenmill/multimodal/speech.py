"""A speech model's prompt inputs: one audio window (at most 30 s, as vLLM's multi_modal_data {"audio": (samples,
sample_rate)}) becomes its log-mel frames, the feature the encoder stage reads; the decoder prompt is Whisper's
special tokens (an empty prompt: transcribe, no timestamps). Longer audio is cut into windows by the
transcription front end (multimodal/transcription.py), one request a window."""

from __future__ import annotations

from typing import Any

from tokenmill.config import MediaOptions, ModelConfig
from tokenmill.multimodal.audio import SAMPLE_RATE, WINDOW_SECONDS, AudioWindow, checked_audio, log_mel
from tokenmill.multimodal.inputs import MultiModalFeature, TensorData, content_hash, media_items
from tokenmill.multimodal.processing import MultiModalPrompt
from tokenmill.multimodal.transcription import TranscriptionOptions, window_prompts
from tokenmill.multimodal.whisper_tokens import whisper_tokens


def is_speech_model(model_config: ModelConfig) -> bool:
    return bool(getattr(model_config.hf_config, "is_encoder_decoder", False))


def audio_feature(samples, n_mels: int) -> MultiModalFeature:
    """One window's feature. Its single position is the decoder prompt's first token: that block's hash takes
    the audio's, and the prefix cache's chained hashes carry it to every later block."""
    mel = log_mel(samples, n_mels)
    data = {"input_features": mel}
    return MultiModalFeature("audio", content_hash("audio", data), 0, 1, {"input_features": TensorData.from_numpy(mel)})


class AudioProcessor:
    add_special_tokens = False   # a Whisper prompt names its special tokens itself
    requires_media = True

    def __init__(self, model_config: ModelConfig, media: MediaOptions):
        self.n_mels = int(model_config.hf_config.num_mel_bins)
        self.max_seconds = media.max_audio_seconds
        self.tokens = whisper_tokens(model_config.tokenizer, model_config.hf_config)

    def apply(self, token_ids: list[int], mm_data: dict[str, Any]) -> MultiModalPrompt:
        raw = media_items(mm_data, "audio", "(samples, sample_rate)")
        items = [raw] if isinstance(raw, tuple) or not isinstance(raw, list) else raw
        if raw is None or len(items) != 1:
            raise ValueError("multi_modal_data: a speech model's prompt takes exactly one audio item")
        samples = checked_audio(items[0], self.max_seconds, "multi_modal_data.audio")
        if len(samples) > WINDOW_SECONDS * SAMPLE_RATE:
            raise ValueError(f"multi_modal_data.audio is {len(samples) / SAMPLE_RATE:.1f} s long: one prompt takes "
                             f"at most {WINDOW_SECONDS} s (LLM.transcribe and /v1/audio/transcriptions cut longer "
                             "audio into windows)")
        ids = list(token_ids) or self.tokens.prompt()
        return MultiModalPrompt(ids, [audio_feature(samples, self.n_mels)])

    def needs_detection(self, opts: TranscriptionOptions) -> bool:
        """A multilingual model given no language detects it first (as Whisper does, from the first 30 s)."""
        return self.tokens.multilingual and not opts.language

    def detection_request(self, samples) -> tuple[list[int], MultiModalFeature]:
        """The prompt and feature of a one-token request whose token is the clip's language (the runner's rules
        leave only language tokens after a bare <|startoftranscript|>)."""
        return [self.tokens.sot], audio_feature(samples[:WINDOW_SECONDS * SAMPLE_RATE], self.n_mels)

    def language_of(self, token_id: int) -> str:
        codes = {i: c for c, i in self.tokens.languages.items()}
        if token_id not in codes:
            raise RuntimeError(f"language detection gave token {token_id}, not a language token")
        return codes[token_id]

    def windows(self, samples, opts: TranscriptionOptions,
                tokenizer) -> list[tuple[AudioWindow, list[int], MultiModalFeature]]:
        """A whole clip as its windows, each with its decoder prompt and its audio feature (one request each)."""
        return [(w, ids, audio_feature(samples[w.start:w.end], self.n_mels))
                for w, ids in window_prompts(samples, self.tokens, tokenizer, opts)]
