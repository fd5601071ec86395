"""Images from what clients send: PIL images, raw bytes, and `image_url` URLs (data:, http(s):, file:), each
decoded by Pillow under limits. Every refusal is a ValueError naming what was wrong, which the server turns into
a 400: an image must never crash a request or hang a worker."""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from tokenmill.config import MediaOptions

# what Pillow decodes and clients send; others (PSD, EPS through Ghostscript, ...) are refused before decoding
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def decode_image(data: bytes, opts: MediaOptions, what: str = "image") -> Image.Image:
    """RGB pixels of encoded image bytes; undecodable, unsupported or oversized images are ValueErrors."""
    if not data:
        raise ValueError(f"{what} is empty")
    if len(data) > opts.max_media_bytes:
        raise ValueError(f"{what} is {len(data)} bytes, over the limit of {opts.max_media_bytes} (--max-media-bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError as e:
        raise ValueError(f"{what} could not be decoded: not an image in a supported format "
                         f"({', '.join(f.lower() for f in IMAGE_FORMATS)})") from e
    except Exception as e:  # noqa: BLE001 - Pillow raises many types on broken headers
        raise ValueError(f"{what} could not be decoded: {type(e).__name__}: {e}") from e
    return checked_image(img, opts, what, load=True)


def checked_image(img, opts: MediaOptions, what: str = "image", load: bool = False) -> Image.Image:
    """An image within the pixel limit, decoded and in RGB (the mode every vision tower takes)."""
    if not isinstance(img, Image.Image):
        raise ValueError(f"{what} must be a PIL image, got {type(img).__name__}")
    w, h = img.size
    if w < 1 or h < 1:
        raise ValueError(f"{what} has no pixels ({w}x{h})")
    if w * h > opts.max_image_pixels:
        raise ValueError(f"{what} is {w}x{h} = {w * h} pixels, over the limit of {opts.max_image_pixels} "
                         "(--max-image-pixels)")
    if load:
        try:
            img.load()
        except Exception as e:  # noqa: BLE001 - truncated or corrupt data shows only when decoded
            raise ValueError(f"{what} could not be decoded: {type(e).__name__}: {e}") from e
    return img if img.mode == "RGB" else img.convert("RGB")


def load_image_url(url: str, opts: MediaOptions, what: str = "image_url") -> Image.Image:
    """The image a URL names: data: (base64), http(s): (fetched under the timeout and byte limit, public hosts
    only unless --allowed-media-domains names the host) or file: (under --allowed-local-media-path only)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{what}.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, opts, what), opts, what)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, opts, what), opts, what)
    if scheme == "file":
        return decode_image(_local_file(url, opts, what), opts, what)
    raise ValueError(f"{what}.url must be a data:, http(s): or file: URL, got {url[:40]!r}")


def _data_url_bytes(url: str, opts: MediaOptions, what: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"{what}.url: a data URL must be data:<type>;base64,<data>")
    media_type = header[5:].split(";")[0].lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"{what}.url: data URL of type {media_type!r} is not an image")
    if len(payload) * 3 // 4 > opts.max_media_bytes:
        raise ValueError(f"{what} is over the limit of {opts.max_media_bytes} bytes (--max-media-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what}.url: the data URL is not valid base64") from e


def _check_host(url: str, opts: MediaOptions, what: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    if not host:
        raise ValueError(f"{what}.url has no host")
    if opts.allowed_media_domains:
        if host.lower() not in opts.allowed_media_domains:
            raise ValueError(f"{what}.url: host {host!r} is not in --allowed-media-domains")
        return
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise ValueError(f"{what}.url: host {host!r} could not be resolved") from e
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%")[0])
        if not ip.is_global:
            raise ValueError(f"{what}.url: host {host!r} is on a private or local network; name it in "
                             "--allowed-media-domains to allow it")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to a host the same rules allow (a public URL must not lead inside)."""

    def __init__(self, opts: MediaOptions, what: str):
        self.opts, self.what = opts, what

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise ValueError(f"{self.what}.url redirects to a non-http URL")
        _check_host(newurl, self.opts, self.what)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, opts: MediaOptions, what: str) -> bytes:
    _check_host(url, opts, what)
    opener = urllib.request.build_opener(_CheckedRedirects(opts, what))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "tokenmill"}),
                         timeout=opts.fetch_timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > opts.max_media_bytes:
                raise ValueError(f"{what}.url: the image is {length} bytes, over the limit of "
                                 f"{opts.max_media_bytes} (--max-media-bytes)")
            data = resp.read(opts.max_media_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ValueError(f"{what}.url could not be fetched: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:   # refused, unreachable, timed out
        reason = getattr(e, "reason", e)
        raise ValueError(f"{what}.url could not be fetched within {opts.fetch_timeout:g} s: {reason}") from e
    if len(data) > opts.max_media_bytes:
        raise ValueError(f"{what}.url: the image is over the limit of {opts.max_media_bytes} bytes "
                         "(--max-media-bytes)")
    return data


def _local_file(url: str, opts: MediaOptions, what: str) -> bytes:
    if opts.allowed_local_media_path is None:
        raise ValueError(f"{what}.url: file: URLs are off; start with --allowed-local-media-path to allow a folder")
    root = Path(opts.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if root != path and root not in path.parents:
        raise ValueError(f"{what}.url: {path} is outside --allowed-local-media-path")
    if not path.is_file():
        raise ValueError(f"{what}.url: no file at {path}")
    if path.stat().st_size > opts.max_media_bytes:
        raise ValueError(f"{what}.url: the file is over the limit of {opts.max_media_bytes} bytes "
                         "(--max-media-bytes)")
    return path.read_bytes()
