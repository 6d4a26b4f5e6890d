"""`deepinfer serve --data-parallel-replicas N`: N engine processes behind the one API server.

ReplicatedEngineClient has the interface Serving uses of one AsyncEngineClient (generate, abort, abort_sample,
abort_all, reset_prefix_cache, stats, ready, dead, dead_event, shutdown). Each request goes to the replica
RouterState picks from the request's block hashes (computed here with the engines' own chain_hashes), the
replicas' prefix-cache events (engine option kv_events) and the router's exact in-flight token counts (every
request starts and ends here, so the load needs no polling: cost = prompt + max_tokens, released at the end).

Invariants:
- A request's outputs, aborts and sample aborts all go to the replica it was routed to.
- A dead replica (its process exited) or a hung one (no message, stats included, for `hang_timeout_s`; engines
  report at least every 0.25 s) leaves rotation at once: its in-flight requests raise ReplicaLost (a
  request that got nothing yet is retried once on another replica), the others keep serving, and a fresh
  engine process is started in its place, which rejoins rotation when it is ready. The client is dead, and
  the server exits, only when every replica is dead at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

from deepinfer.engine.kv_cache import chain_hashes
from deepinfer.engine.messages import EngineStats
from deepinfer.multimodal.inputs import image_keys
from deepinfer.router.metrics import RouterCollector, RouterStats
from deepinfer.router.policy import NoReplica, RouterConfig
from deepinfer.router.state import RouterState
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_client import AsyncEngineClient, EngineDeadError, ReplicaLost, request_cost

logger = logging.getLogger("deepinfer.router")


HANG_TIMEOUT_S = 1.5  # with the 0.25 s check: a silent replica is given up within 2 s
HEALTH_INTERVAL_S = 0.25
RESTART_BACKOFF_S = 1.0


class ReplicatedEngineClient:
    def __init__(self, clients: Sequence[AsyncEngineClient], config: RouterConfig, model: str | None = None,
                 engine_kwargs: dict | None = None, hang_timeout_s: float = HANG_TIMEOUT_S):
        """engine_kwargs (with model) lets a lost replica be restarted; None: it stays out of rotation."""
        self.clients, self.config = list(clients), config
        self.model, self.engine_kwargs, self.hang_timeout_s = model, engine_kwargs, hang_timeout_s
        self.restarts = 0
        self.ready = self.clients[0].ready
        self.state = RouterState(config, range(len(self.clients)))
        self.router_stats = RouterStats()
        self.dead_event = asyncio.Event()
        self.closed = False
        self._owner: dict[str, int] = {}
        for i, client in enumerate(self.clients):
            self._attach(i, client)
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(len(self.clients))]
        self._watchers.append(asyncio.create_task(self._health()))

    @classmethod
    async def start(cls, model: str | None, engine_kwargs: dict, replicas: int, config: RouterConfig,
                    startup_timeout: float | None = None) -> ReplicatedEngineClient:
        """Start `replicas` engines (each its own process, and its own ranks if multi-rank) concurrently."""
        kwargs = {**engine_kwargs, "kv_events": True}
        started = await asyncio.gather(*(AsyncEngineClient.start(model, kwargs, startup_timeout)
                                         for _ in range(replicas)), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(c.shutdown() for c in started if not isinstance(c, BaseException)))
            raise failed[0]
        return cls(started, config, model, kwargs)

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
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    # --- requests --------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       kv_transfer: dict | None = None, images: list | None = None) -> AsyncIterator:
        """AsyncEngineClient.generate on the replica the router picks for the request; retried once on
        another replica when its replica is lost before the request produced anything, else ReplicaLost
        (the server answers 503)."""
        for attempt in (0, 1):
            replica, cost = self._route(request_id, prompt_token_ids, params, cache_salt, images)
            client, produced = self.clients[replica], False
            try:
                async for out in client.generate(request_id, prompt_token_ids, params, priority, cache_salt,
                                                 kv_transfer, images):
                    if out.finish_reason == "error" and client.dead:
                        if not produced and attempt == 0:
                            break  # lost before anything reached the caller: route again
                        self.router_stats.rejections["engine_lost"] += 1
                        raise ReplicaLost(f"engine replica {replica} was lost while the request ran "
                                          f"({client.dead_reason})")
                    produced = True
                    yield out
            finally:
                self._owner.pop(request_id, None)
                self.state.finished(replica, cost)
            if produced:
                return
            self.router_stats.retries += 1
            logger.warning("request %s: replica %d was lost before it started; retrying", request_id, replica)

    def _route(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None, images: list | None = None) -> tuple[int, int]:
        if self.dead or self.closed:
            raise EngineDeadError(self.dead_reason or "the engine client is shut down")
        hashes = chain_hashes(prompt_token_ids, self.ready.block_size, cache_salt, [], image_keys(images))
        cost = request_cost(len(prompt_token_ids), params)
        try:
            decision = self.state.choose(hashes, cost, sticky_key=cache_salt)
        except NoReplica as e:
            self.router_stats.rejections["no_engine"] += 1
            raise EngineDeadError(f"no engine replica is serving: {e}") from None
        self.router_stats.record(decision, len(hashes))
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

    @property
    def load_tokens(self) -> int:
        return sum(c.load_tokens for c in self.clients)

    @property
    def last_message(self) -> float:
        """The latest message of any replica (a hung one is given up by _health, not reported as the server's)."""
        return max(c.last_message for c in self.clients)

    # --- state -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats | None:
        """The replicas' latest stats merged (counters summed, kv usage the busiest)."""
        live = [s for c in self.clients if (s := c.stats()) is not None]
        return merge_stats(live) if live else None

    def engine_stats(self) -> dict[str, EngineStats | None]:
        """Each replica's latest stats, by its `engine` label in /metrics."""
        return {str(i): c.stats() for i, c in enumerate(self.clients)}

    def collectors(self) -> list[RouterCollector]:
        return [RouterCollector(self.router_stats, self.state)]

    def _attach(self, replica: int, client: AsyncEngineClient) -> None:
        client.on_kv_events = lambda events: self.state.apply_events(replica, events)

    async def _watch(self, replica: int) -> None:
        """Take a lost replica out of rotation; restart it (while restarts are possible) and put it back."""
        while True:
            client = self.clients[replica]
            await client.dead_event.wait()
            self.state.set_healthy(replica, False)
            logger.error("engine replica %d left rotation: %s", replica, client.dead_reason)
            if self.dead:
                self.dead_event.set()
                return
            if self.engine_kwargs is None:
                return
            await client.shutdown(0.0)
            self.clients[replica] = await self._restart(replica)
            self.state.set_healthy(replica, True)
            logger.info("engine replica %d is back in rotation", replica)

    async def _restart(self, replica: int) -> AsyncEngineClient:
        while True:
            try:
                client = await AsyncEngineClient.start(self.model, self.engine_kwargs)
            except (RuntimeError, OSError) as e:
                logger.error("engine replica %d did not restart (%s); retrying", replica, e)
                await asyncio.sleep(RESTART_BACKOFF_S)
                continue
            self.restarts += 1
            self._attach(replica, client)
            return client

    async def _health(self) -> None:
        """A replica silent for hang_timeout_s hangs: give it up. A late tick of this loop (the server's event
        loop was busy, so messages may be waiting unread) skips the check."""
        tick = time.monotonic()
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            now, late = time.monotonic(), time.monotonic() - tick > 4 * HEALTH_INTERVAL_S
            tick = now
            for replica, client in enumerate(self.clients):
                silent = now - client.last_message
                if not late and not client.dead and replica in self.state.healthy and silent > self.hang_timeout_s:
                    client.fail(f"engine replica {replica} sent nothing for {silent:.1f} s (hung)")


_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "prompt_tokens_total",
           "generation_tokens_total", "num_preemptions", "prefix_queries", "prefix_hits", "spec_num_drafts",
           "spec_num_draft_tokens", "spec_num_accepted_tokens")


def merge_stats(values: Sequence[EngineStats]) -> EngineStats:
    """One EngineStats for several replicas' (counters summed, kv usage the busiest replica's)."""
    sums = {name: sum(getattr(s, name) for s in values) for name in _SUMMED}
    accepted = [sum(x) for x in itertools.zip_longest(*(s.spec_accepted_per_pos for s in values), fillvalue=0)]
    return EngineStats(kv_usage=max(s.kv_usage for s in values), timestamp=max(s.timestamp for s in values),
                       spec_accepted_per_pos=accepted, **sums)
