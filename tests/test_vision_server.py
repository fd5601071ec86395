"""Images through the server: OpenAI image_url parts (data: and http URLs) in streamed and whole chats give the
offline engine's tokens; every bad image is a 400 with an OpenAI-style error and the engine keeps serving."""

from __future__ import annotations

import http.server
import io
import json
import threading
import time

import pytest
import requests
from server_utils import ServerProcess
from vision_utils import build_tiny_llava, data_url, random_image

from tokenmill import LLM, SamplingParams

QUESTION = "What is in the picture?"


class _Images(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(3)
        body = self.png if self.path.endswith(".png") else b"not found"
        self.send_response(200 if self.path.endswith(".png") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    buf = io.BytesIO()
    random_image(90, 56, 2).save(buf, "PNG")
    _Images.png = buf.getvalue()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smol_tokenizer):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-server"), smol_tokenizer)


@pytest.fixture(scope="module")
def server(llava_dir):
    s = ServerProcess(str(llava_dir), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                      "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "10000",
                      "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "1")
    yield s
    s.stop()


def _content(*urls: str) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": QUESTION}]


def _chat(server, content, stream=False, **extra):
    return requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "stream": stream, **extra})


def _streamed_text(resp) -> str:
    text = ""
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += c["delta"].get("content") or ""
    return text


def test_image_chats_equal_offline(server, llava_dir, image_host):
    a, b = random_image(60, 80, 1), random_image(90, 56, 2)   # b is what the image host serves
    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory="16MiB")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.chat([[{"role": "user", "content": _content(data_url(im))}]
                                                 for im in (a, b, None) if im is not None] +
                                                [[{"role": "user", "content": _content(data_url(a), data_url(b))}]],
                                                sp, use_tqdm=False)]
    assert len(set(want)) == 3   # each image has its own answer
    got = [_chat(server, _content(data_url(a))).json()["choices"][0]["message"]["content"],
           _chat(server, _content(image_host + "/b.png")).json()["choices"][0]["message"]["content"],
           _chat(server, _content(data_url(a), image_host + "/b.png")).json()["choices"][0]["message"]["content"]]
    assert got == want
    with _chat(server, _content(image_host + "/b.png"), stream=True, stream_options={"include_usage": True}) as r:
        assert r.status_code == 200 and _streamed_text(r) == want[1]
    count = requests.post(server.url + "/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": _content(data_url(a))}]}).json()["count"]
    assert count == _chat(server, _content(data_url(a))).json()["usage"]["prompt_tokens"]   # 16 per image


def _svg_url() -> str:
    import base64

    return "data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode()


def test_bad_images_are_400s(server, image_host):
    ok = data_url(random_image(60, 80, 1))
    bad = {
        "could not be decoded": _content("data:image/png;base64," + "aGVsbG8gd29ybGQ="),
        "not an image in a supported format": _content(_svg_url()),
        "not valid base64": _content("data:image/png;base64,@@@"),
        "--max-image-pixels": _content(data_url(random_image(120, 100, 3))),
        "over the limit of 2": _content(ok, ok, ok),
        "Connection refused": _content("http://127.0.0.1:1/x.png"),
        "could not be fetched within 1 s": _content(image_host + "/slow.png"),
        "HTTP 404": _content(image_host + "/missing"),
        "not in --allowed-media-domains": _content("http://localhost:9/x.png"),
        "file: URLs are off": _content("file:///etc/hostname"),
        "must be a non-empty string": [{"type": "image_url", "image_url": {}}],
    }
    for words, content in bad.items():
        r = _chat(server, content)
        assert r.status_code == 400, (words, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (words, err)
    assert _chat(server, _content(ok)).status_code == 200   # the engine is unharmed


def test_image_to_a_text_model_is_a_400(guarded_server):
    r = requests.post(guarded_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": _content(data_url(random_image(8, 8, 1)))}], "max_tokens": 4})
    assert r.status_code == 400
    assert "takes no images" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0]"


def test_audio_to_a_model_without_a_speech_encoder_is_a_400(server):
    r = requests.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF....WAVE")},
                      timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and "not a speech model" in err["message"]
