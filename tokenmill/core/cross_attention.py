"""The scheduler's side of an encoder-decoder model's second KV group: cross-attention slots.

A request's encoder runs in the step that first schedules its prompt, and its output's K/V fill one slot, which
the request holds until it finishes or is preempted (a resumed request runs its encoder again). A prompt is
admitted only when a slot is free and the step's encoder budget has room for its audio; otherwise it waits, as
it waits for KV blocks. The same interface as the vision encoder cache (plan, commit, passed, release,
take_step), so the scheduler does not tell the two apart.
"""

from __future__ import annotations

from tokenmill.engine.request import Request


class CrossAttentionSlots:
    def __init__(self, num_slots: int, budget: int, positions_per_item: int):
        self.num_slots, self.budget, self.per_item = num_slots, budget, positions_per_item
        self.holders: set[str] = set()   # requests that hold a slot
        self.step_positions = 0
        self.to_encode: dict[str, list[int]] = {}
        self.num_encoded = 0
        self._counted = 0

    def plan(self, req: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """All num_new tokens when the request holds its slot or can take one this step; none otherwise."""
        if req.request_id in self.holders or not req.mm_features:
            return num_new, []
        if len(self.holders) >= self.num_slots or self.step_positions + self.per_item > self.budget:
            return 0, []
        return num_new, [0]

    def commit(self, req: Request, start: int, num_new: int, new: list[int]) -> None:
        if not new:
            return
        self.holders.add(req.request_id)
        self.step_positions += self.per_item
        self.to_encode[req.request_id] = list(new)
        self.num_encoded += 1

    def passed(self, req: Request) -> None:
        """(the slot is read by every later decode step: it stays until release)"""

    def release(self, req: Request) -> None:
        self.holders.discard(req.request_id)

    def take_counts(self) -> tuple[int, int]:
        encoded, self._counted = self.num_encoded - self._counted, self.num_encoded
        return encoded, 0

    def take_step(self) -> tuple[dict[str, list[int]], list[str]]:
        out = self.to_encode
        self.to_encode, self.step_positions = {}, 0
        return out, []
