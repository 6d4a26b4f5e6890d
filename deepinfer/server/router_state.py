"""What a `deepinfer serve` instance tells a `deepinfer router` in front of it: `GET /router/state?since=N`.

The answer is the server's load (request_cost of its open engine requests, exact and current), whether its
engine is alive and talking, and its prefix-cache events numbered 1, 2, ... since it started (engine option
--kv-events; without it the router balances on load alone). A router polls with the last number it saw.

Invariants:
- events keep the engine's order and numbers are consecutive, so `since` N returns exactly the events after
  N, or `complete: false` when some of them are no longer kept (the router forgets the server's blocks and
  starts again from what is kept);
- `instance` changes whenever the server restarts, so a router never mixes two lives of one address.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable
from itertools import islice

EVENTS_KEPT = 1 << 16


class EventLog:
    """The engine's prefix-cache events, numbered, the last EVENTS_KEPT of them kept."""

    def __init__(self, capacity: int = EVENTS_KEPT):
        self.events: deque[tuple[int, str, str | None]] = deque(maxlen=capacity)  # (number, kind, hash hex)
        self.last = 0

    def append(self, events: Iterable[tuple[str, bytes | None]]) -> None:
        """AsyncEngineClient.on_kv_events: ("stored" | "evicted", hash) and ("cleared", None), in order."""
        for kind, block_hash in events:
            self.last += 1
            self.events.append((self.last, kind, block_hash.hex() if block_hash is not None else None))

    def since(self, number: int) -> tuple[bool, list[tuple[int, str, str | None]]]:
        """(complete, the kept events numbered above `number`): complete unless some were dropped."""
        oldest = self.events[0][0] if self.events else self.last + 1
        start = max(0, number + 1 - oldest)
        return number + 1 >= oldest, list(islice(self.events, start, None))


class RouterStateView:
    """The body of GET /router/state for one server."""

    def __init__(self, client, block_size: int, isolation: str, log: EventLog | None):
        self.client, self.block_size, self.isolation, self.log = client, block_size, isolation, log
        self.instance = uuid.uuid4().hex

    def state(self, since: int) -> dict:
        complete, events = self.log.since(since) if self.log is not None else (True, [])
        silent = time.monotonic() - getattr(self.client, "last_message", time.monotonic())
        return {"instance": self.instance, "block_size": self.block_size, "prefix_cache_isolation": self.isolation,
                "kv_events": self.log is not None, "alive": not self.client.dead, "engine_silent_s": silent,
                "load_tokens": getattr(self.client, "load_tokens", 0), "num_requests": self.client.num_in_flight,
                "last_event": self.log.last if self.log is not None else 0, "complete": complete,
                "events": [[kind, block_hash] for _, kind, block_hash in events]}
