"""Where a request goes: to the replica whose prefix cache holds its prompt's first blocks (keyed by their chained
hash, as the engine computes it after the chat template), unless that replica is truly overloaded; otherwise to the
least-loaded replica.

A prefix keeps the home its first request chose for as long as that replica serves: scaling up adds replicas
that take new prefixes first instead of taking over old ones (which would recompute their prompts), and scaling
down moves only the prefixes of the replica that left. The ring of consistent hashing breaks ties, so an idle fleet
places keys by weight. The load bound ("consistent hashing with bounded loads", as vLLM's router also does) keeps
one hot prefix from piling onto one replica."""

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
    """A prefix's first request picks its home: the least-loaded replica, ties broken by the key's place on the
    ring (so an idle fleet spreads keys by weight, and a replica that just joined takes new prompts first). Later
    requests with that prefix go home unless it is truly overloaded: past both `load_factor` times its fair share
    and its fair share plus `slack` requests; then they walk the ring to the next replica with room, and the home
    stays. A home leaves only with its replica (removed, drained, scaled down): replicas coming and going never move
    the prefixes of the others."""

    def __init__(self, load_factor: float = 1.25, remember: int = 10000, rng: random.Random | None = None,
                 slack: float = 2.0):
        self.load_factor, self.slack = load_factor, slack
        self.rng = rng or random.Random()
        self._ring: list[tuple[int, str]] = []
        self._ring_of: tuple = ()
        self.home_of: OrderedDict[bytes, str] = OrderedDict()   # prefix key -> its replica's URL, LRU
        self.remember = remember

    def _ring_for(self, backends: list[Backend]) -> list[tuple[int, str]]:
        sig = tuple(sorted((b.url, b.weight) for b in backends))
        if sig != self._ring_of:
            self._ring = sorted((_point(f"{b.url}#{i}".encode()), b.url)
                                for b in backends for i in range(max(1, round(VNODES * b.weight))))
            self._ring_of = sig
        return self._ring

    def _ring_order(self, candidates: list[Backend], key: bytes) -> list[Backend]:
        """The candidates in the order the key's walk around the ring meets them."""
        ring, by_url = self._ring_for(candidates), {b.url: b for b in candidates}
        start = bisect.bisect(ring, (_point(key), ""))
        seen: dict[str, Backend] = {}
        for i in range(len(ring)):
            url = ring[(start + i) % len(ring)][1]
            seen.setdefault(url, by_url[url])
            if len(seen) == len(by_url):
                break
        return list(seen.values())

    def has_room(self, b: Backend, candidates: list[Backend]) -> bool:
        total = sum(c.outstanding for c in candidates) + 1
        fair = total * b.weight / sum(c.weight for c in candidates)
        return b.outstanding + 1 <= max(1.0, self.load_factor * fair, fair + self.slack)

    def choose(self, backends: list[Backend], key: bytes | None, exclude: set[str] = frozenset()) -> Decision | None:
        candidates = [b for b in backends if b.url not in exclude]
        if not candidates:
            return None
        if key is None:
            low = min(b.load() for b in candidates)
            tied = [b for b in candidates if b.load() == low]
            return Decision(self.rng.choices(tied, weights=[b.weight for b in tied])[0], "least_loaded", None)
        order = self._ring_order(candidates, key)
        home = next((b for b in order if b.url == self.home_of.get(key)), None)
        if home is None:   # a new prefix (or its home left): the least loaded, in ring order among equals
            low = min(b.load() for b in order)
            home = next(b for b in order if b.load() == low)
            self._set_home(key, home)
            return Decision(home, "affinity", key)
        self.home_of.move_to_end(key)
        if self.has_room(home, candidates):
            return Decision(home, "affinity", key, cache_hit=True)
        spill = next((b for b in order if b is not home and self.has_room(b, candidates)), None)
        if spill is None:
            return Decision(home, "affinity", key, cache_hit=True)
        return Decision(spill, "affinity_overflow", key)

    def _set_home(self, key: bytes, b: Backend) -> None:
        self.home_of[key] = b.url
        self.home_of.move_to_end(key)
        while len(self.home_of) > self.remember:
            self.home_of.popitem(last=False)
