"""The routing decision, a pure function (no clock, no I/O): tested on CPU in tests/test_router_policy.py.

Inputs are what a router sees of its replicas: which block hashes each one holds in its prefix cache (from the
stored / evicted events replicas publish), each one's load in tokens (queued + running), health, and the
request's chained block hashes (engine/kv_cache.chain_hashes: block i's hash covers blocks 0..i, so a replica
holding hash i can serve the whole prefix up to i once it also holds every earlier hash).

Policies:
- round_robin: healthy replicas in turn.
- least_loaded: the fewest queued + running tokens (ties: the lowest replica id).
- cache_aware: the longest cached prefix, unless load is uneven (the busiest replica's load exceeds the idlest's
  by more than `balance_abs_tokens` and by more than `balance_rel` times), then the least loaded. Among replicas
  with the same longest prefix: the request's sticky replica (its cache_salt / conversation was routed there
  before) when it is one of them, else the least loaded of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    balance_abs_tokens: int = 4096  # load gap (tokens) above which, with balance_rel, load wins over cache hits
    balance_rel: float = 2.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs_tokens < 0 or self.balance_rel < 1:
            raise ValueError("balance_abs_tokens must be >= 0 and balance_rel >= 1")


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str  # round_robin | least_loaded | prefix | sticky | imbalance
    matched_blocks: int  # leading blocks of the request the chosen replica holds


class NoReplica(RuntimeError):
    """No healthy replica to route to."""


def matched_blocks(block_hashes: Sequence[bytes], holders: Mapping[bytes, frozenset[int] | set[int]],
                   replicas: Sequence[int]) -> dict[int, int]:
    """Per replica, how many leading blocks of the request it holds (a chain stops at its first missing block)."""
    matched, alive = dict.fromkeys(replicas, 0), set(replicas)
    for i, h in enumerate(block_hashes):
        alive &= holders.get(h, set())
        if not alive:
            break
        for r in alive:
            matched[r] = i + 1
    return matched


def imbalanced(loads: Mapping[int, int], config: RouterConfig) -> bool:
    low, high = min(loads.values()), max(loads.values())
    return high - low > config.balance_abs_tokens and high > config.balance_rel * max(low, 1)


def least_loaded(loads: Mapping[int, int], among: Sequence[int]) -> int:
    return min(among, key=lambda r: (loads[r], r))


def route(block_hashes: Sequence[bytes], healthy: Sequence[int], loads: Mapping[int, int],
          holders: Mapping[bytes, frozenset[int] | set[int]], config: RouterConfig, sticky: int | None = None,
          turn: int = 0) -> Decision:
    """The replica for one request. loads: tokens per healthy replica; turn: the round-robin counter."""
    if not healthy:
        raise NoReplica("no healthy replica")
    healthy = sorted(healthy)
    if config.policy == "round_robin":
        return _decision(healthy[turn % len(healthy)], "round_robin", block_hashes, holders)
    if config.policy == "least_loaded" or imbalanced({r: loads[r] for r in healthy}, config):
        reason = "least_loaded" if config.policy == "least_loaded" else "imbalance"
        return _decision(least_loaded(loads, healthy), reason, block_hashes, holders)
    matched = matched_blocks(block_hashes, holders, healthy)
    best = max(matched.values())
    tied = [r for r in healthy if matched[r] == best]
    if sticky in tied and (len(tied) > 1 or best == 0):
        return Decision(sticky, "sticky", best)
    choice = least_loaded(loads, tied)
    return Decision(choice, "prefix" if best else "least_loaded", best)


def _decision(replica: int, reason: str, block_hashes, holders) -> Decision:
    return Decision(replica, reason, matched_blocks(block_hashes, holders, [replica])[replica])
