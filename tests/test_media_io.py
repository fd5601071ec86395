"""Media input rules without a model: which URLs load, what the encoder cache keeps, and how a prompt chunk is
cut before an image whose embeddings cannot be ready."""

from __future__ import annotations

import pytest
from vision_utils import random_image

from tokenmill.config import MediaOptions
from tokenmill.core.encoder_cache import EncoderCacheManager
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.multimodal.media_io import load_image_url


def test_private_hosts_need_naming():
    opts = MediaOptions(fetch_timeout=0.5)
    for url in ("http://127.0.0.1:1/a.png", "http://10.1.2.3/a.png", "http://[::1]:1/a.png",
                "http://169.254.169.254/latest"):
        with pytest.raises(ValueError, match="private or local network"):
            load_image_url(url, opts)
    with pytest.raises(ValueError, match="could not be fetched"):   # named: tried (and refused by the port)
        load_image_url("http://127.0.0.1:1/a.png", MediaOptions(fetch_timeout=0.5,
                                                                 allowed_media_domains=("127.0.0.1",)))
    with pytest.raises(ValueError, match="must be a data:, http"):
        load_image_url("ftp://example.com/a.png", opts)


def test_file_urls_only_under_the_allowed_folder(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    random_image(10, 12, 1).save(inside / "a.png")
    (tmp_path / "b.png").write_bytes((inside / "a.png").read_bytes())
    opts = MediaOptions(allowed_local_media_path=str(inside))
    assert load_image_url(f"file://{inside}/a.png", opts).size == (12, 10)
    for url in (f"file://{tmp_path}/b.png", f"file://{inside}/../b.png"):
        with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
            load_image_url(url, opts)
    with pytest.raises(ValueError, match="file: URLs are off"):
        load_image_url(f"file://{inside}/a.png", MediaOptions())


class _Req:
    def __init__(self, rid: str, *items: tuple[str, int, int]):
        self.request_id = rid
        self.mm_features = [MultiModalFeature("image", ident, offset, length, {}) for ident, offset, length in items]
        self.num_computed_tokens = 0


def test_chunk_stops_before_an_image_the_cache_cannot_hold():
    enc = EncoderCacheManager(capacity=16, budget=16)
    a = _Req("a", ("x", 3, 16), ("y", 22, 16))
    assert enc.plan(a, 0, 30) == (22, [0])          # y would not fit beside x: the chunk stops before it
    enc.commit(a, 0, 22, [0])
    a.num_computed_tokens = 22
    enc.passed(a)
    assert enc.take_step() == ({"a": [0]}, [])
    assert enc.plan(a, 22, 8) == (8, [1])           # x is done with: evicted for y
    enc.commit(a, 22, 8, [1])
    assert enc.take_step() == ({"a": [1]}, ["x"])


def test_a_later_cached_image_does_not_block_an_earlier_one():
    """A resumed prompt whose prefix hit ends inside image x, while the cache holds its later image y: x is
    encoded (y dropped) and the chunk stops before y, instead of waiting for ever."""
    enc = EncoderCacheManager(capacity=16, budget=16)
    enc.commit(_Req("other", ("y", 0, 16)), 0, 16, [0])
    enc.release(_Req("other", ("y", 0, 16)))
    enc.take_step()
    a = _Req("a", ("x", 3, 16), ("y", 22, 16))
    assert enc.plan(a, 16, 8) == (6, [0])


def test_pinned_images_are_never_evicted_and_reuse_counts():
    enc = EncoderCacheManager(capacity=32, budget=16)
    a, b = _Req("a", ("x", 0, 16)), _Req("b", ("y", 0, 16), ("x", 20, 16))
    enc.commit(a, 0, 8, [0])                        # a is half way through x
    assert enc.plan(b, 0, 40) == (0, [])            # this step's encoder budget went to x
    enc.take_step()
    assert enc.plan(b, 0, 40) == (40, [0])          # y encoded; x found cached
    enc.commit(b, 0, 40, [0])
    assert (enc.num_encoded, enc.num_hits) == (2, 1)
    c = _Req("c", ("z", 0, 16))
    assert enc.plan(c, 0, 16) == (0, [])            # x and y are pinned: no room for z
    enc.release(a)
    enc.release(b)
    assert enc.plan(c, 0, 16) == (0, [])            # the step's encoder budget is spent on y
    enc.take_step()
    assert enc.plan(c, 0, 16) == (16, [0])
