"""Speculative-decoding counters (the engine's; the server exports them as Prometheus counters)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rounds with at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts by position (0-based)
    drafted_per_pos: list[int] = field(default_factory=list)  # verified drafts by position

    def observe(self, num_verified: int, num_accepted: int) -> None:
        if num_verified <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        for counts in (self.drafted_per_pos, self.accepted_per_pos):
            counts.extend([0] * (num_verified - len(counts)))
        for i in range(num_verified):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < num_accepted

    def acceptance_by_position(self, prior: float = 0.5, prior_weight: int = 8) -> list[float]:
        """Empirical P(draft i accepted | drafts < i accepted), shrunk towards `prior` while data is scarce."""
        rates = []
        for i, drafted in enumerate(self.drafted_per_pos):
            reached = self.accepted_per_pos[i - 1] if i else self.num_drafts
            reached = min(reached, drafted)
            rates.append((self.accepted_per_pos[i] + prior * prior_weight) / (reached + prior_weight))
        return rates

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round, the bonus/correction token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
