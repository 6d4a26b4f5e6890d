"""`deepinfer serve --data-parallel-replicas N`: N engine processes behind the one API server.

ReplicatedEngineClient has the interface Serving uses of one AsyncEngineClient (generate, abort, abort_sample,
abort_all, reset_prefix_cache, stats, ready, dead, dead_event, shutdown). Each request goes to the replica
RouterState picks from the request's block hashes (computed here with the engines' own chain_hashes), the
replicas' prefix-cache events (engine option kv_events) and the router's exact in-flight token counts (every
request starts and ends here, so the load needs no polling: cost = prompt + max_tokens, released at the end).

Invariants:
- A request's outputs, aborts and sample aborts all go to the replica it was routed to.
- A dead replica leaves rotation at once (its AsyncEngineClient fails its in-flight requests with an error
  output); the others keep serving. The client is dead, and the server exits, only when every replica is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from deepinfer.engine.kv_cache import chain_hashes
from deepinfer.engine.messages import EngineStats, ReplicaMetrics
from deepinfer.router.policy import NoReplica, RouterConfig
from deepinfer.router.state import RouterState
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_client import AsyncEngineClient, EngineDeadError

logger = logging.getLogger("deepinfer.router")


class ReplicatedEngineClient:
    def __init__(self, clients: Sequence[AsyncEngineClient], config: RouterConfig):
        self.clients, self.config = list(clients), config
        self.ready = self.clients[0].ready
        self.state = RouterState(config, range(len(self.clients)))
        self.decisions: Counter[str] = Counter()  # routed requests by decision reason
        self.dead_event = asyncio.Event()
        self.closed = False
        self._owner: dict[str, int] = {}
        for i, client in enumerate(self.clients):
            client.on_kv_events = lambda events, i=i: self.state.apply_events(i, events)
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(len(self.clients))]

    @classmethod
    async def start(cls, model: str | None, engine_kwargs: dict, replicas: int, config: RouterConfig,
                    startup_timeout: float = 120.0) -> ReplicatedEngineClient:
        """Start `replicas` engines (each its own process, and its own ranks if multi-rank) concurrently."""
        kwargs = {**engine_kwargs, "kv_events": True}
        started = await asyncio.gather(*(AsyncEngineClient.start(model, kwargs, startup_timeout)
                                         for _ in range(replicas)), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(c.shutdown() for c in started if not isinstance(c, BaseException)))
            raise failed[0]
        return cls(started, config)

    @property
    def dead(self) -> bool:
        return all(c.dead for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        return "; ".join(f"replica {i}: {c.dead_reason}" for i, c in enumerate(self.clients)) if self.dead else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    # --- requests --------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator:
        """AsyncEngineClient.generate on the replica the router picks for the request."""
        replica, cost = self._route(request_id, prompt_token_ids, params, cache_salt)
        try:
            async for out in self.clients[replica].generate(request_id, prompt_token_ids, params, priority,
                                                            cache_salt):
                yield out
        finally:
            self._owner.pop(request_id, None)
            self.state.finished(replica, cost)

    def _route(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None) -> tuple[int, int]:
        if self.dead or self.closed:
            raise EngineDeadError(self.dead_reason or "the engine client is shut down")
        hashes = chain_hashes(prompt_token_ids, self.ready.block_size, cache_salt, [])
        cost = len(prompt_token_ids) + params.n * (params.max_tokens or 0)
        try:
            decision = self.state.choose(hashes, cost, sticky_key=cache_salt)
        except NoReplica as e:
            raise EngineDeadError(f"no engine replica is serving: {e}") from None
        self.decisions[decision.reason] += 1
        self._owner[request_id] = decision.replica
        return decision.replica, cost

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await self.clients[replica].abort(request_id)

    def abort_sample(self, request_id: str, index: int) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            self.clients[replica].abort_sample(request_id, index)

    def abort_all(self) -> None:
        for client in self.clients:
            client.abort_all()

    def reset_prefix_cache(self) -> None:
        for client in self.clients:
            client.reset_prefix_cache()  # each replica's "cleared" event reaches the router

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    # --- state -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats | None:
        """The replicas' latest stats merged (counters summed, kv usage the busiest), one `replicas` entry each."""
        live = [(i, c.stats()) for i, c in enumerate(self.clients) if c.stats() is not None]
        return merge_stats(live, dict(self.decisions)) if live else None

    async def _watch(self, replica: int) -> None:
        client = self.clients[replica]
        await client.dead_event.wait()
        self.state.set_healthy(replica, False)
        logger.error("engine replica %d left rotation: %s", replica, client.dead_reason)
        if self.dead:
            self.dead_event.set()


_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "prompt_tokens_total",
           "generation_tokens_total", "num_preemptions", "prefix_queries", "prefix_hits", "spec_num_drafts",
           "spec_num_draft_tokens", "spec_num_accepted_tokens")


def merge_stats(stats: Sequence[tuple[int, EngineStats]], decisions: dict[str, int] | None = None) -> EngineStats:
    """One EngineStats for replicas' stats (replica id, stats): what /metrics shows of them together."""
    values = [s for _, s in stats]
    sums = {name: sum(getattr(s, name) for s in values) for name in _SUMMED}
    accepted = [sum(x) for x in itertools.zip_longest(*(s.spec_accepted_per_pos for s in values), fillvalue=0)]
    per_replica = [ReplicaMetrics(i, s.num_running, s.num_waiting, s.kv_usage) for i, s in stats]
    return EngineStats(kv_usage=max(s.kv_usage for s in values), timestamp=max(s.timestamp for s in values),
                       spec_accepted_per_pos=accepted, replicas=per_replica,
                       ranks=[r for s in values for r in s.ranks], router_decisions=decisions or {}, **sums)
