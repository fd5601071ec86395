"""The scheduler's side of the encoder stage: which media embeddings the worker's encoder cache holds (by
content hash), which items the encoder computes this step, and which entries the worker may drop.

A request's scheduled range [start, start + n) may reach an image only if the image's embeddings are cached or
are encoded in the same step; otherwise the range stops before the image (and waits for the next step's budget).
An entry is pinned while some request still has placeholders of it to compute; unpinned entries stay cached,
oldest dropped first, so the same image sent again skips the encoder.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.engine.request import Request


class EncoderCacheManager:
    def __init__(self, capacity: int, budget: int):
        self.capacity, self.budget = capacity, budget
        self.cached: OrderedDict[str, int] = OrderedDict()   # identifier -> embeddings, least recently used first
        self.users: dict[str, set[str]] = {}   # identifier -> requests that still have its placeholders to compute
        self.used = 0
        self.step_tokens = 0
        self.to_encode: dict[str, list[int]] = {}   # request id -> indices of its items encoded this step
        self.freed: list[str] = []                  # identifiers the worker drops before this step's encoding
        self.num_encoded = 0   # items encoded, and items found cached (since start; take_counts: since last taken)
        self.num_hits = 0
        self._counted = (0, 0)

    def plan(self, req: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """How many of the num_new tokens from `start` may be scheduled, and the request's items that must be
        encoded for them. Items are taken in prompt order while all those the range reaches fit in the cache
        beside what other requests pin (and the new ones in the step's budget); the range stops before the
        first that does not. Changes nothing (commit does, once the tokens have their KV slots)."""
        end = start + num_new
        needed: set[str] = set()   # the items reached so far: cached or encoded, all held at once this step
        size = 0   # their embeddings
        others = sum(n for k, n in self.cached.items() if k in self.users)   # pinned, and not yet among them
        new: list[int] = []
        encode = 0
        for i, f in enumerate(req.mm_features):
            if f.offset >= end or f.end <= start or f.identifier in needed:
                continue   # (the same picture twice in one prompt is encoded once)
            fresh = f.identifier not in self.cached
            own = f.length if f.identifier in self.users else 0   # already counted in `others`
            if others - own + size + f.length > self.capacity or (fresh and self.step_tokens + encode + f.length >
                                                                  self.budget):
                return max(0, f.offset - start), new
            needed.add(f.identifier)
            others -= own
            size += f.length
            if fresh:
                new.append(i)
                encode += f.length
        return num_new, new

    def commit(self, req: Request, start: int, num_new: int, new: list[int]) -> None:
        end = start + num_new
        encoded = {req.mm_features[i].identifier for i in new}
        for f in req.mm_features:   # pin what the range reaches first, so making room never drops it
            if f.offset < end and f.end > start and (f.identifier in self.cached or f.identifier in encoded):
                users = self.users.setdefault(f.identifier, set())
                if f.identifier not in encoded and req.request_id not in users:
                    self.num_hits += 1
                    self.cached.move_to_end(f.identifier)
                users.add(req.request_id)
        for i in new:   # (plan gave each picture once, none of them cached)
            f = req.mm_features[i]
            self._evict_for(f.length)
            self.cached[f.identifier] = f.length
            self.used += f.length
            self.step_tokens += f.length
            self.to_encode.setdefault(req.request_id, []).append(i)
            self.num_encoded += 1

    def passed(self, req: Request) -> None:
        """After a step is scheduled: items whose placeholders the request has all computed no longer pin."""
        for f in req.mm_features:
            if f.end <= req.num_computed_tokens:
                self._unpin(f.identifier, req.request_id)

    def release(self, req: Request) -> None:
        """A request finished or preempted: it pins nothing (a resumed one plans its items again)."""
        for f in req.mm_features:
            self._unpin(f.identifier, req.request_id)

    def take_counts(self) -> tuple[int, int]:
        """Items encoded and encoder-cache hits since the last call (the stats' counters)."""
        encoded, hits = self.num_encoded - self._counted[0], self.num_hits - self._counted[1]
        self._counted = (self.num_encoded, self.num_hits)
        return encoded, hits

    def take_step(self) -> tuple[dict[str, list[int]], list[str]]:
        out = self.to_encode, self.freed
        self.to_encode, self.freed, self.step_tokens = {}, [], 0
        return out

    def _unpin(self, identifier: str, request_id: str) -> None:
        users = self.users.get(identifier)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.users[identifier]

    def _evict_for(self, tokens: int) -> None:
        for identifier in list(self.cached):
            if self.capacity - self.used >= tokens:
                return
            if identifier not in self.users:
                self.used -= self.cached.pop(identifier)
                self.freed.append(identifier)
