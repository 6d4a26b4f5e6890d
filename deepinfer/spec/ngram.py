"""Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the history's last n tokens
(longest n first) and propose the tokens that followed it. No weights, no cache."""

from __future__ import annotations

from deepinfer.spec.base import Draft, ProposeBatch, Proposer


def lookup(history: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    for n in range(min(n_max, len(history) - 1), n_min - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, k: int, n_max: int = 4, n_min: int = 1):
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        out = {}
        for item in batch.items:
            k = min(self.k, item.max_drafts)
            if k > 0:
                out[item.request_id] = Draft(lookup(item.history, k, self.n_max, self.n_min))
        return out
