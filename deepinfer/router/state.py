"""What a router knows of its replicas between load refreshes, and the optimistic bumps it makes meanwhile.

One owner (the router's event loop) calls it; nothing here blocks. Invariants:
- holders[h] is the set of replicas believed to hold block hash h: the replicas' own stored / evicted events,
  plus the blocks of requests routed to a replica since (assumed stored: the replica is computing them).
- loads[r] is replica r's last reported queued + running tokens plus what was routed to it since.
- A replica that leaves rotation forgets its blocks (when it comes back its cache is not to be trusted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from deepinfer.router.policy import Decision, RouterConfig, route


class RouterState:
    def __init__(self, config: RouterConfig, replicas: Sequence[int], sticky_capacity: int = 65536):
        self.config, self.sticky_capacity = config, sticky_capacity
        self.loads = dict.fromkeys(replicas, 0)
        self.healthy = set(replicas)
        self.holders: dict[bytes, set[int]] = {}
        self.sticky: OrderedDict[str, int] = OrderedDict()  # cache_salt / conversation -> replica, LRU
        self.turn = 0

    def choose(self, block_hashes: Sequence[bytes], num_tokens: int, sticky_key: str | None = None) -> Decision:
        """Route one request and bump the chosen replica's load and blocks optimistically."""
        sticky = self.sticky.get(sticky_key) if sticky_key is not None else None
        loads = {r: self.loads[r] for r in self.healthy}
        decision = route(block_hashes, sorted(self.healthy), loads, self.holders, self.config, sticky, self.turn)
        self.turn += 1
        self.loads[decision.replica] += num_tokens
        self.stored(decision.replica, block_hashes)
        if sticky_key is not None:
            self.sticky[sticky_key] = decision.replica
            self.sticky.move_to_end(sticky_key)
            while len(self.sticky) > self.sticky_capacity:
                self.sticky.popitem(last=False)
        return decision

    def finished(self, replica: int, tokens: int) -> None:
        """A request routed to `replica` with cost `tokens` is done (until the next report, if any)."""
        self.loads[replica] = max(0, self.loads[replica] - tokens)

    def report_load(self, replica: int, tokens: int) -> None:
        """A fresh load report replaces the estimate (and the bumps made since the last one)."""
        self.loads[replica] = tokens

    def stored(self, replica: int, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.holders.setdefault(h, set()).add(replica)

    def evicted(self, replica: int, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            holders = self.holders.get(h)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self.holders[h]

    def cleared(self, replica: int) -> None:
        """The replica's prefix cache was reset (or it left rotation): it holds nothing."""
        self.evicted(replica, [h for h, rs in self.holders.items() if replica in rs])

    def apply_events(self, replica: int, events: Iterable[tuple[str, bytes | None]]) -> None:
        """A replica's prefix-cache events (engine/kv_cache.BlockPool.drain_events), in order."""
        for kind, block_hash in events:
            if kind == "stored":
                self.stored(replica, [block_hash])
            elif kind == "evicted":
                self.evicted(replica, [block_hash])
            else:
                self.cleared(replica)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        if healthy:
            self.healthy.add(replica)
            return
        self.healthy.discard(replica)
        self.cleared(replica)
        self.loads[replica] = 0
        for key in [k for k, r in self.sticky.items() if r == replica]:
            del self.sticky[key]
