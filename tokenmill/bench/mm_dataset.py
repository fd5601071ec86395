"""Image chats for `tokenmill bench serve --dataset random-mm`: each request a user message of generated images
(seeded noise, PNG data URLs, so every engine gets the same bytes) and a question, and the vision encoder's time
read from the server's /metrics (tokenmill's; other engines report none)."""

from __future__ import annotations

import base64
import io

import numpy as np


def image_sizes(spec: str) -> list[tuple[int, int]]:
    """'336x336,640x480' -> [(336, 336), (640, 480)] as (width, height)."""
    sizes = []
    for part in spec.split(","):
        w, _, h = part.strip().lower().partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
            raise ValueError(f"--random-mm-image-size must be WxH[,WxH...], got {spec!r}")
        sizes.append((int(w), int(h)))
    return sizes


def image_contents(num_requests: int, images_per_request: int, sizes: list[tuple[int, int]], questions: list[str],
                   seed: int) -> list[list[dict]]:
    """Per request: its content parts (images first, then the question); image k of the run has size k mod N."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    k = 0
    for i in range(num_requests):
        parts = []
        for _ in range(images_per_request):
            w, h = sizes[k % len(sizes)]
            k += 1
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
            parts.append({"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
        parts.append({"type": "text", "text": questions[i]})
        out.append(parts)
    return out


async def encoder_totals(session, base_url: str, headers: dict) -> dict[str, float] | None:
    """tokenmill's encoder counters from /metrics (None where the server has none)."""
    try:
        async with session.get(base_url + "/metrics", headers=headers) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except Exception:  # noqa: BLE001 - no metrics endpoint: nothing to report
        return None
    totals = {}
    for line in text.splitlines():
        for name in ("encoder_seconds", "encoder_items", "encoder_cache_hits"):
            if line.startswith(f"tokenmill:{name}_total"):
                totals[name] = float(line.rsplit(" ", 1)[1])
    return totals or None


def encoder_summary(before: dict | None, after: dict | None, num_ok: int, mean_ttft: float) -> dict:
    if not before or not after:
        return {}
    seconds = after.get("encoder_seconds", 0.0) - before.get("encoder_seconds", 0.0)
    items = after.get("encoder_items", 0.0) - before.get("encoder_items", 0.0)
    per_request = seconds / max(num_ok, 1)
    return dict(encoder_seconds=seconds, encoder_items=int(items),
                encoder_ms_per_image=1000 * seconds / items if items else 0.0,
                encoder_share_of_ttft=per_request / mean_ttft if mean_ttft else 0.0)
