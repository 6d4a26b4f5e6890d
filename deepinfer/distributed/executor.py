"""Driver side of a multi-rank engine: the ranks, the step channel to them, and failure detection.

The driver (the process holding the schedulers: ``LLM``, or the server's engine process) binds a ZeroMQ
ROUTER; every rank connects a DEALER (``distributed/worker.py``). A step sends each rank its replica's
ReplicaPlan (every rank gets one, idle or not, so all ranks step together) and waits for one RunnerOutput per
DP replica from its TP rank 0.

Failure detection is bounded: a rank that raises reports its traceback; a rank that dies or stops
heartbeating is seen by the WorkerGroup monitor (spawned ranks); a step whose answers do not all arrive within
``distributed_timeout_s`` fails (any rank, torchrun-started ones included). After a failure the executor is
dead: every later call raises ``RanksFailed`` at once (``fatal``: the serving loop exits instead of failing
only that step's requests).
"""

from __future__ import annotations

import functools
import logging
import pickle
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import zmq

from deepinfer.config import EngineArgs
from deepinfer.distributed.launcher import WorkerGroup, WorkerOptions
from deepinfer.distributed.layout import make_layout
from deepinfer.distributed.plan import PlanEncoder, ReplicaPlan
from deepinfer.distributed.worker import RankInfo, RankStats, WorkerSpec, run_rank
from deepinfer.engine.outputs import RunnerOutput, SchedulerOutput

logger = logging.getLogger("deepinfer")
POLL_MS = 100
BLAME_WAIT_S = 2.0  # after a rank reports an error, how long the monitor may take to name a dead or hung peer


class RanksFailed(RuntimeError):
    """A rank died, raised, hung or did not answer in time; the multi-rank engine cannot continue."""

    fatal = True


class Executor:
    def __init__(self, model_path: str | Path, args: EngineArgs):
        self.args, self.layout = args, make_layout(args.parallel)
        self.dead: str | None = None
        self.step_id = 0
        self._pending: dict[tuple[int, int], PendingStep] = {}  # (round, replica) -> its answer, until it comes
        self._stats: dict[tuple[int, int], RankStats] = {}
        self._round: dict[int, PendingStep] = {}
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address, self.group = self._bind(args.driver_address), None
        try:
            self.group = self._start(model_path, args)
            self.ranks = self._await_ready(startup_allowance(args))
        except BaseException:  # a failed start-up releases its ranks and sockets now (a context left to the
            _close(self.sock, self._ctx, self.group, self.layout.world_size)  # GC would block in term())
            raise
        self.encoders = [PlanEncoder() for _ in range(args.parallel.data_parallel_size)]
        self._finalizer = weakref.finalize(self, _close, self.sock, self._ctx, self.group, self.layout.world_size)

    def _bind(self, address: str) -> str:
        host, _, port = address.rpartition(":")
        if port == "0":
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            self.sock.bind(f"tcp://{host}:{port}")
        return f"{'127.0.0.1' if host in ('0.0.0.0', '*') else host}:{port}"

    def _start(self, model_path: str | Path, args: EngineArgs) -> WorkerGroup | None:
        if args.distributed_workers == "external":
            logger.info("waiting for %d torchrun ranks to connect to %s", self.layout.world_size, self.address)
            return None
        spec = WorkerSpec(str(model_path), args, f"tcp://{self.address}")
        options = WorkerOptions(pg_timeout_s=args.distributed_timeout_s, startup_timeout_s=startup_allowance(args),
                                hang_timeout_s=max(1.0, min(30.0, args.distributed_timeout_s)))
        return WorkerGroup(run_rank, args.parallel, (spec,), options)

    # --- start-up -------------------------------------------------------------------------------
    def _await_ready(self, timeout_s: float) -> dict[int, RankInfo]:
        ranks: dict[int, RankInfo] = {}
        deadline = time.monotonic() + timeout_s
        while len(ranks) < self.layout.world_size:
            kind, rank, payload = self._receive(deadline, f"start-up ({len(ranks)} of {self.layout.world_size} ranks "
                                                          f"ready; start-up allowance {timeout_s:g} s)")
            if kind != "ready":
                raise RanksFailed(f"rank {rank} sent {kind!r} before it was ready")
            ranks[rank] = payload
        first = ranks[0]
        for info in ranks.values():
            if (info.layout, info.replay_tokens) != (first.layout, first.replay_tokens):
                raise RanksFailed(f"rank {info.rank} disagrees with rank 0 on the cache layout")
        return ranks

    @property
    def cache_layout(self):
        return self.ranks[0].layout

    @property
    def replay_tokens(self) -> int:
        return self.ranks[0].replay_tokens

    # --- stepping -------------------------------------------------------------------------------
    # A round is one step of every DP replica: each replica with work submits its plan, the others get an
    # empty plan at end_round (their ranks still step). Each plan's answer comes back as a PendingStep; answers
    # are matched by (round, replica), so rounds may overlap (async scheduling submits round N + 1 before
    # collecting round N).
    def execute(self, steps: list[tuple[SchedulerOutput, set[str]] | None]) -> list[RunnerOutput | None]:
        """One synchronous round: steps[d] is replica d's (output, ids its scheduler still tracks), or None when
        it has nothing to run. Returns each replica's RunnerOutput (None for idle ones)."""
        self.begin_round()
        pending = [None if step is None else self.submit(d, *step) for d, step in enumerate(steps)]
        self.end_round()
        return [None if p is None else p.result() for p in pending]

    def begin_round(self) -> None:
        if self.dead is not None:
            raise RanksFailed(self.dead)
        self.step_id += 1
        self._round: dict[int, PendingStep] = {}

    def submit(self, d: int, out: SchedulerOutput, live: set[str], defer_grammar: bool = False) -> PendingStep:
        """Send replica d's plan for this round. defer_grammar: out's bitmask is resolved later, on this thread
        (async scheduling); it follows the plan as its own message once resolved."""
        plan = self.encoders[d].encode(out, live, defer_grammar)
        self._send(d, ("step", self.step_id, plan))
        if plan.grammar_pending:
            out.grammar_bitmask.add_done_callback(functools.partial(self._send_mask, d, self.step_id))
        return self._expect(d)

    def end_round(self) -> None:
        """Empty plans for the replicas that submitted nothing this round (none if no replica submitted)."""
        if not self._round:
            return
        for d in range(len(self.encoders)):
            if d not in self._round:
                self._send(d, ("step", self.step_id, ReplicaPlan()))
                self._expect(d)

    def _expect(self, d: int) -> PendingStep:
        pending = self._round[d] = self._pending[(self.step_id, d)] = PendingStep(self, (self.step_id, d))
        return pending

    def _send(self, d: int, message: tuple) -> None:
        payload = pickle.dumps(message)
        for rank in self.layout.tp_groups[d]:
            self.sock.send_multipart([f"rank{rank}".encode(), payload])

    def _send_mask(self, d: int, step: int, future) -> None:
        mask = None if future.exception() is not None else future.result()
        if self.dead is None:
            self._send(d, ("mask", step, mask))

    def wait_for(self, key: tuple[int, int]) -> None:
        """Receive answers until the one for `key` is in (others are filed as they come)."""
        deadline = time.monotonic() + self.args.distributed_timeout_s
        while key in self._pending:
            self._file(self._receive(deadline, f"step {key[0]} of replica {key[1]}"))

    def _file(self, message: tuple) -> None:
        kind, step, who, value = message
        if kind == "result" and (step, who) in self._pending:
            self._pending.pop((step, who)).set_result(value)
        elif kind == "stats":
            self._stats[(step, who)] = value

    def _receive(self, deadline: float, what: str) -> tuple:
        """The next message from any rank; RanksFailed on a reported error, a dead or hung rank, or the
        deadline (the executor is dead afterwards)."""
        while not self.sock.poll(POLL_MS):
            self._check(deadline, what)
        _, payload = self.sock.recv_multipart()
        message = pickle.loads(payload)
        if message[0] == "error":
            self._die(self._blame(message[1], message[2], what))
        return message

    def _blame(self, rank: int, trace: str, what: str) -> str:
        """A rank's reported error, after the peers' fates: a rank whose peer died or hung fails in a
        collective first (connection reset, timeout), so the monitor gets a moment to name the cause."""
        deadline = time.monotonic() + BLAME_WAIT_S
        while self.group is not None and time.monotonic() < deadline and not set(self.group.failures) - {rank}:
            time.sleep(0.05)
        others = {} if self.group is None else self.group.failures
        causes = "; ".join(f"rank {r}: {why}" for r, why in sorted(others.items()) if r != rank)
        last = trace.strip().splitlines()[-1] if trace.strip() else "no traceback"
        own = f"rank {rank} failed during {what}: {last}"
        return f"{causes}; then {own}" if causes else f"{own}\n{trace}"

    def _check(self, deadline: float, what: str) -> None:
        failures = self.group.failures if self.group is not None else {}
        if failures:
            self._die("; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items())))
        if time.monotonic() > deadline:
            self._die(f"the ranks did not answer {what} in time (distributed_timeout_s "
                      f"{self.args.distributed_timeout_s:g} s)")

    def _die(self, reason: str) -> None:
        """Fail for good: every answer still expected fails too (so nothing waits on it)."""
        self.dead = f"multi-rank engine failed: {reason}"
        logger.error("%s", self.dead)
        error = RanksFailed(self.dead)
        for pending in self._pending.values():
            if not pending.done():
                pending.set_exception(error)
        self._pending.clear()
        raise error

    def expert_load(self, stats: list[RankStats] | None = None):
        """[MoE layers, experts] tokens routed over the ranks' stats window (None without EP statistics)."""
        from deepinfer.eplb.stats import summed_load

        return summed_load(stats if stats is not None else self.rank_stats())

    def expert_balancedness(self, stats: list[RankStats] | None = None) -> list[float]:
        """Per MoE layer, mean / max tokens per EP rank under the layers' current placements (replicas sharing
        their expert's load evenly); [] without EP."""
        from deepinfer.eplb.policy import placement_balancedness
        from deepinfer.eplb.stats import layer_balancedness

        stats = stats if stats is not None else self.rank_stats()
        load = self.expert_load(stats)
        if load is None:
            return []
        ep = len(self.layout.ep_group)
        placement = next((s.expert_placement for s in stats if s.expert_placement), None)
        if placement is None or len(placement[0]) % ep:  # uneven contiguous blocks: no replicas, per block
            from deepinfer.distributed.moe_comm import place_experts

            return layer_balancedness(load, place_experts(load.shape[1], ep).starts)
        import torch

        return placement_balancedness(load, torch.tensor(placement), ep)

    def rank_stats(self) -> list[RankStats]:
        """Every rank's RankStats, in rank order (answered after the steps already sent to it)."""
        if self.dead is not None:
            raise RanksFailed(self.dead)
        self.step_id += 1
        stats_id = self.step_id
        payload = pickle.dumps(("stats", stats_id, None))
        for rank in range(self.layout.world_size):
            self.sock.send_multipart([f"rank{rank}".encode(), payload])
        deadline = time.monotonic() + self.args.distributed_timeout_s
        while len([k for k in self._stats if k[0] == stats_id]) < self.layout.world_size:
            self._file(self._receive(deadline, "a stats request"))
        return [self._stats.pop((stats_id, r)) for r in range(self.layout.world_size)]

    # --- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the ranks (idempotent; also runs on garbage collection and at interpreter exit)."""
        self._finalizer()


def startup_allowance(args: EngineArgs) -> float:
    """How long ranks may take to import torch, load their shards and plan their caches."""
    return max(120.0, 4 * args.distributed_timeout_s)


def _close(sock: zmq.Socket, ctx: zmq.Context, group: WorkerGroup | None, world: int) -> None:
    stop = pickle.dumps(("stop", 0, None))
    for rank in range(world):
        try:
            sock.send_multipart([f"rank{rank}".encode(), stop], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    if group is not None:
        group.close()
    sock.close(linger=1000)  # torchrun ranks must still get their stop (they would see a disconnect instead)
    ctx.term()


class PendingStep(Future):
    """A replica's answer to one round; result() receives answers (on the driver's thread) until it is in."""

    def __init__(self, executor: Executor, key: tuple[int, int]):
        super().__init__()
        self.executor, self.key = executor, key

    def result(self, timeout: float | None = None):
        if not self.done():
            self.executor.wait_for(self.key)
        return super().result(timeout)


class ReplicaRunner:
    """What EngineCore sees of DP replica d's ranks: their agreed cache layout and (data_parallel_size 1
    only) execute(). With several replicas, DPEngineCore steps them all through Executor.execute at once."""

    def __init__(self, executor: Executor, replica: int):
        self.executor, self.replica = executor, replica
        self.layout, self.replay_tokens = executor.cache_layout, executor.replay_tokens
        self.scheduler = None  # the replica's Scheduler, set once its EngineCore exists

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.executor.execute([(out, set(self.scheduler.requests))])[0]

    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Async scheduling: send this replica's plan now; the answer is collected when result() is called.
        data_parallel_size 1 opens and closes its own round; DPEngineCore opens rounds for all replicas."""
        own_round = len(self.executor.encoders) == 1
        if own_round:
            self.executor.begin_round()
        pending = self.executor.submit(self.replica, out, set(self.scheduler.requests), defer_grammar=True)
        if own_round:
            self.executor.end_round()
        return pending

    def close(self) -> None:
        self.executor.close()
