"""Images in chat messages: OpenAI's `image_url` content parts (and vLLM's `image_pil`, offline) become the
chat template's `{"type": "image"}` parts, and their URLs are loaded, in message order, off the event loop."""

from __future__ import annotations

import asyncio

from tokenmill.config import MediaOptions
from tokenmill.multimodal.media_io import load_image_url

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def template_messages(messages: list[dict], takes_images: bool) -> tuple[list[dict], list]:
    """Message dicts for the template and the images their parts name, as (where, URL or PIL image given
    offline). A text model's content list is joined to its text parts; an image part sent to it is a ValueError."""
    out, images = [], []
    for i, m in enumerate(messages):
        d = dict(m)
        content = d.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind in IMAGE_PART_TYPES:
                    if not takes_images:
                        raise ValueError(f"messages[{i}].content[{j}] is an image part, and this model takes no "
                                         "images (it has no vision tower)")
                    where = f"messages[{i}].content[{j}]"
                    images.append((f"{where}.{p['type']}", _image_of(p, where)))
                    parts.append({"type": "image"})
                elif kind == "text":
                    parts.append({"type": "text", "text": p.get("text", "")})
            d["content"] = parts if takes_images else "".join(p["text"] for p in parts)
        d.setdefault("content", "")   # OpenAI allows none (an assistant's tool calls); templates expect a string
        out.append(d)
    return out, images


def _image_of(part: dict, where: str):
    if part["type"] == "image_pil":
        return part.get("image_pil")
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url.url must be a non-empty string")
    return url


def load_images(items: list[tuple[str, object]], media: MediaOptions) -> list:
    """URLs loaded (PIL images passed through), each error naming its part."""
    return [load_image_url(x, media, where) if isinstance(x, str) else x for where, x in items]


async def load_images_async(items: list, media: MediaOptions) -> list:
    """load_images in a thread: a fetch waits up to --media-fetch-timeout, and decoding takes CPU."""
    if not items:
        return []
    return await asyncio.to_thread(load_images, items, media)
