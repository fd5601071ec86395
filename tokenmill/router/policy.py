"""Where a request goes: to the replica whose prefix cache most likely holds its prompt's first blocks
(consistent hashing of their chained hash, as the engine computes it after the chat template), unless that
replica is already carrying more than its share of the load; otherwise to the least-loaded replica.

Consistent hashing keeps a prefix on one replica while replicas come and go (only the keys of a removed
replica move); the load bound (vLLM's router and "consistent hashing with bounded loads" use the same idea)
keeps one hot prefix from piling onto one replica: past `load_factor` times the mean load, the key walks on
to the next replica on the ring."""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.router.backends import Backend

VNODES = 64   # points on the ring per unit of weight


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class Decision:
    backend: Backend
    reason: str        # "affinity", "affinity_overflow" (the key's replica was too loaded), "least_loaded"
    key: bytes | None
    cache_hit: bool = False   # the previous request with this prefix went to the same replica


class PrefixKeyer:
    """The hash of a prompt's leading full blocks (at most `max_blocks`), chained as the engine's prefix cache
    chains them; None for a prompt shorter than one block."""

    def __init__(self, tokenizer, block_size: int = 16, max_blocks: int = 4):
        self.tokenizer, self.block_size, self.max_blocks = tokenizer, block_size, max_blocks

    def key_for(self, body: dict, chat: bool) -> bytes | None:
        try:
            ids = self._token_ids(body, chat)
        except Exception:   # noqa: BLE001 - a prompt the router cannot render still gets routed, by load
            return None
        if not ids:
            return None
        ids = ids[: self.block_size * self.max_blocks]
        hashes: list = []
        salt = body.get("cache_salt")
        extend_block_hashes(hashes, ids, self.block_size, salt.encode() if isinstance(salt, str) else b"")
        return hashes[-1].value if hashes else None

    def _token_ids(self, body: dict, chat: bool) -> list[int] | None:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            msgs = [{**m, "content": _text(m.get("content"))} for m in messages if isinstance(m, dict)]
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]          # a batch of prompts goes where its first one goes
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int)]
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        return None


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


class Router:
    def __init__(self, load_factor: float = 1.25, remember: int = 10000, rng: random.Random | None = None):
        self.load_factor = load_factor
        self.rng = rng or random.Random()
        self._ring: list[tuple[int, str]] = []
        self._ring_of: tuple = ()
        self.last_backend_of: OrderedDict[bytes, str] = OrderedDict()   # for the cache-affinity hit count
        self.remember = remember

    def _ring_for(self, backends: list[Backend]) -> list[tuple[int, str]]:
        sig = tuple(sorted((b.url, b.weight) for b in backends))
        if sig != self._ring_of:
            self._ring = sorted((_point(f"{b.url}#{i}".encode()), b.url)
                                for b in backends for i in range(max(1, round(VNODES * b.weight))))
            self._ring_of = sig
        return self._ring

    def choose(self, backends: list[Backend], key: bytes | None, exclude: set[str] = frozenset()) -> Decision | None:
        candidates = [b for b in backends if b.url not in exclude]
        if not candidates:
            return None
        by_url = {b.url: b for b in candidates}
        if key is not None:
            ring = self._ring_for(candidates)
            total = sum(b.outstanding for b in candidates) + 1
            weight = sum(b.weight for b in candidates)
            start = bisect.bisect(ring, (_point(key), ""))
            first = None
            for i in range(len(ring)):
                b = by_url[ring[(start + i) % len(ring)][1]]
                first = first or b
                bound = self.load_factor * total * b.weight / weight
                if b.outstanding + 1 <= max(1.0, bound):
                    return self._remember(Decision(b, "affinity" if b is first else "affinity_overflow", key))
        low = min(b.load() for b in candidates)
        tied = [b for b in candidates if b.load() == low]
        pick = self.rng.choices(tied, weights=[b.weight for b in tied])[0]
        return self._remember(Decision(pick, "least_loaded", key))

    def _remember(self, d: Decision) -> Decision:
        if d.key is not None:
            d.cache_hit = self.last_backend_of.get(d.key) == d.backend.url
            self.last_backend_of[d.key] = d.backend.url
            self.last_backend_of.move_to_end(d.key)
            while len(self.last_backend_of) > self.remember:
                self.last_backend_of.popitem(last=False)
        return d
