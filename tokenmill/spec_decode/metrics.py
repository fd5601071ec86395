"""Acceptance counters of speculative decoding, summed over steps: for the log line, `bench` and LLM users."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingTotals:
    num_drafts: int = 0               # verifications (a request's drafts in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # drafts accepted at position 0, 1, ...

    def add(self, stats) -> None:
        """Adds one step's SchedulerStats (its spec_* fields)."""
        if not stats.spec_num_drafts:
            return
        self.num_drafts += stats.spec_num_drafts
        self.num_draft_tokens += stats.spec_num_draft_tokens
        self.num_accepted_tokens += stats.spec_num_accepted_tokens
        per_pos = stats.spec_accepted_per_pos
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields: the accepted drafts plus the target's own token (vLLM's figure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def as_dict(self) -> dict:
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens, acceptance_rate=round(self.acceptance_rate, 4),
                    mean_acceptance_length=round(self.mean_acceptance_length, 3),
                    accepted_per_pos=list(self.accepted_per_pos),
                    acceptance_rate_per_pos=[round(r, 4) for r in self.per_position_rates()])

    def describe(self) -> str:
        rates = ", ".join(f"{r:.3f}" for r in self.per_position_rates())
        return (f"Mean acceptance length: {self.mean_acceptance_length:.2f}, Accepted: {self.num_accepted_tokens} "
                f"tokens, Drafted: {self.num_draft_tokens} tokens, Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%")
