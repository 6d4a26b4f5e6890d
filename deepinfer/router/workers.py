"""`deepinfer router`'s view of the `deepinfer serve` instances it fronts: polled state, health, routing.

Each worker's GET /router/state (server/router_state.py) is polled every `poll_interval_s` (50 ms by default):
its load replaces the router's estimate, its prefix-cache events update which block hashes it holds.

Invariants:
- A worker is in rotation only while its last good poll is at most `health_timeout_s` old and it reported its
  engine alive and heard from within `hang_timeout_s`. A refused connection takes it out at once, a hung
  server within health_timeout_s + one poll timeout, a hung engine within hang_timeout_s + one poll interval
  (both under 2 s by default). An engine step longer than hang_timeout_s looks hung: raise it for big models
  on slow devices.
- Leaving rotation sets the worker's `lost` event (which its in-flight requests wait on beside their responses)
  and forgets its blocks, load and sticky keys; rejoining gives it a fresh, unset event.
- A new `instance` (the server restarted) or an incomplete event answer makes the router forget the worker's
  blocks before applying what it is sent, so it never believes a block the worker may not hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from deepinfer.router.policy import Decision, RouterConfig
from deepinfer.router.state import RouterState

logger = logging.getLogger("deepinfer.router")

POLL_INTERVAL_S = 0.05
HEALTH_TIMEOUT_S = 1.0  # a server that answered no poll for this long leaves rotation
HANG_TIMEOUT_S = 1.5  # an engine silent for this long (it reports every 0.25-0.4 s) leaves rotation
POLL_TIMEOUT_S = 0.5


@dataclass
class Worker:
    index: int
    url: str
    instance: str | None = None
    last_event: int = 0
    last_ok: float = 0.0  # monotonic time of the last good poll
    block_size: int | None = None
    isolation: str = "none"
    kv_events: bool = False
    reason: str = "not polled yet"  # why it is out of rotation
    lost: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerPool:
    def __init__(self, urls: Sequence[str], config: RouterConfig, api_key: str | None = None,
                 poll_interval_s: float = POLL_INTERVAL_S, health_timeout_s: float = HEALTH_TIMEOUT_S,
                 hang_timeout_s: float = HANG_TIMEOUT_S):
        self.workers = [Worker(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.state = RouterState(config, range(len(self.workers)))
        self.state.healthy.clear()  # nobody is in rotation before its first good poll
        self.poll_interval_s, self.health_timeout_s = poll_interval_s, health_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=POLL_TIMEOUT_S), trust_env=False,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._polls: list[asyncio.Task] = []

    def start(self) -> None:
        self._polls = [asyncio.create_task(self._poll(w)) for w in self.workers]

    async def close(self) -> None:
        for task in self._polls:
            task.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)
        await self.http.aclose()

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once at least one worker is in rotation."""
        deadline = time.monotonic() + timeout_s
        while not self.state.healthy and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_interval_s)
        return bool(self.state.healthy)

    # --- routing ---------------------------------------------------------------------------------
    @property
    def block_size(self) -> int | None:
        """The block size of the workers in rotation (they must agree for their hashes to be comparable)."""
        sizes = {self.workers[i].block_size for i in self.state.healthy}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def isolation(self) -> str:
        """The workers' --prefix-cache-isolation ("key" if any in rotation keys prefixes by API key)."""
        return "key" if any(self.workers[i].isolation == "key" for i in self.state.healthy) else "none"

    def reasons(self) -> str:
        """Why each worker out of rotation is out."""
        out = [f"worker {w.index} ({w.url}): {w.reason}" for w in self.workers if w.index not in self.state.healthy]
        return "; ".join(out) or "every worker is in rotation"

    def choose(self, block_hashes: list[bytes], cost: int, sticky_key: str | None) -> tuple[Worker, Decision]:
        """RouterState.choose (raises NoReplica when no worker is in rotation)."""
        decision = self.state.choose(block_hashes, cost, sticky_key)
        return self.workers[decision.replica], decision

    def finished(self, worker: Worker, cost: int) -> None:
        self.state.finished(worker.index, cost)

    def any_worker(self) -> Worker | None:
        """The least loaded worker in rotation, for requests that need no routing (models, tokenize, ...)."""
        healthy = sorted(self.state.healthy, key=lambda i: (self.state.loads[i], i))
        return self.workers[healthy[0]] if healthy else None

    # --- polling ---------------------------------------------------------------------------------
    async def _poll(self, worker: Worker) -> None:
        while True:
            try:
                state = await self._fetch(worker)
            except (httpx.HTTPError, asyncio.TimeoutError, TimeoutError, OSError, ValueError, KeyError) as e:
                self._failed(worker, e)
            else:
                self._apply(worker, state)
            await asyncio.sleep(self.poll_interval_s)

    async def _fetch(self, worker: Worker) -> dict:
        response = await asyncio.wait_for(
            self.http.get(f"{worker.url}/router/state", params={"since": worker.last_event}, headers=self.headers),
            POLL_TIMEOUT_S)
        response.raise_for_status()
        return response.json()

    def _failed(self, worker: Worker, error: Exception) -> None:
        refused = isinstance(error, httpx.ConnectError)
        stale = time.monotonic() - worker.last_ok > self.health_timeout_s
        if refused or stale:
            self.leave(worker, f"/router/state failed ({type(error).__name__}: {error})" if str(error) else
                        f"/router/state did not answer for {self.health_timeout_s} s")

    def _apply(self, worker: Worker, state: dict) -> None:
        worker.last_ok = time.monotonic()
        if state["instance"] != worker.instance:
            self._new_instance(worker, state)
            return  # the events answered were numbered for the old instance: ask again from 0
        if not state["complete"]:
            self.state.cleared(worker.index)
        self.state.apply_events(worker.index, [(kind, bytes.fromhex(h) if h else None) for kind, h in state["events"]])
        worker.last_event = state["last_event"]
        if not state["alive"] or state["engine_silent_s"] > self.hang_timeout_s:
            self.leave(worker, "its engine is dead" if not state["alive"] else
                        f"its engine sent nothing for {state['engine_silent_s']:.1f} s (hung)")
            return
        self._join(worker)
        self.state.report_load(worker.index, state["load_tokens"])

    def _new_instance(self, worker: Worker, state: dict) -> None:
        if worker.instance is not None:
            logger.warning("worker %d (%s) restarted: its cached blocks are forgotten", worker.index, worker.url)
        self.state.cleared(worker.index)
        worker.instance, worker.last_event = state["instance"], 0
        worker.block_size, worker.isolation, worker.kv_events = (state["block_size"], state["prefix_cache_isolation"],
                                                                 state["kv_events"])
        if not worker.kv_events:
            logger.warning("worker %d (%s) publishes no prefix-cache events (serve it with --kv-events): it is "
                           "routed by load only", worker.index, worker.url)

    def _join(self, worker: Worker) -> None:
        if worker.index in self.state.healthy:
            return
        worker.lost = asyncio.Event()
        self.state.set_healthy(worker.index, True)
        logger.info("worker %d (%s) is in rotation", worker.index, worker.url)

    def leave(self, worker: Worker, reason: str) -> None:
        """Out of rotation until a good poll brings it back (also called by requests that lost the worker)."""
        if worker.index not in self.state.healthy:
            worker.reason = reason
            return
        worker.reason = reason
        worker.lost.set()
        self.state.set_healthy(worker.index, False)
        logger.error("worker %d (%s) left rotation: %s", worker.index, worker.url, reason)
