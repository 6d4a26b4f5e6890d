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

import logging
import pickle
import time
import weakref
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


class RanksFailed(RuntimeError):
    """A rank died, raised, hung or did not answer in time; the multi-rank engine cannot continue."""

    fatal = True


class Executor:
    def __init__(self, model_path: str | Path, args: EngineArgs):
        self.args, self.layout = args, make_layout(args.parallel)
        self.dead: str | None = None
        self.step_id = 0
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = self._bind(args.driver_address)
        self.group = self._start(model_path, args)
        self.ranks = self._await_ready(startup_allowance(args))
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
    def execute(self, steps: list[tuple[SchedulerOutput, set[str]] | None]) -> list[RunnerOutput | None]:
        """One step of every DP replica: steps[d] is replica d's (output, ids its scheduler still tracks), or
        None when it has nothing to run. Returns each replica's RunnerOutput (None for idle ones)."""
        if self.dead is not None:
            raise RanksFailed(self.dead)
        self.step_id += 1
        plans = [self._plan(d, step) for d, step in enumerate(steps)]
        for d, plan in enumerate(plans):
            self._send_plan(d, plan)
        return self._collect(plans)

    def _plan(self, d: int, step: tuple[SchedulerOutput, set[str]] | None) -> ReplicaPlan:
        return ReplicaPlan() if step is None else self.encoders[d].encode(*step)

    def _send_plan(self, d: int, plan: ReplicaPlan) -> None:
        payload = pickle.dumps(("step", self.step_id, plan))
        for rank in self.layout.tp_groups[d]:
            self.sock.send_multipart([f"rank{rank}".encode(), payload])

    def _collect(self, plans: list[ReplicaPlan]) -> list[RunnerOutput | None]:
        results: dict[int, RunnerOutput | None] = {}
        deadline = time.monotonic() + self.args.distributed_timeout_s
        while len(results) < len(plans):
            kind, step, d, result = self._receive(deadline, f"step {self.step_id}")
            if kind == "result" and step == self.step_id:
                results[d] = result
        return [results[d] for d in range(len(plans))]

    def _receive(self, deadline: float, what: str) -> tuple:
        """The next message from any rank; RanksFailed on a reported error, a dead or hung rank, or the
        deadline (the executor is dead afterwards)."""
        while not self.sock.poll(POLL_MS):
            self._check(deadline, what)
        _, payload = self.sock.recv_multipart()
        message = pickle.loads(payload)
        if message[0] == "error":
            self._die(f"rank {message[1]} failed during {what}:\n{message[2]}")
        return message

    def _check(self, deadline: float, what: str) -> None:
        failures = self.group.failures if self.group is not None else {}
        if failures:
            self._die("; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items())))
        if time.monotonic() > deadline:
            self._die(f"the ranks did not answer {what} in time (distributed_timeout_s "
                      f"{self.args.distributed_timeout_s:g} s)")

    def _die(self, reason: str) -> None:
        self.dead = f"multi-rank engine failed: {reason}"
        logger.error("%s", self.dead)
        raise RanksFailed(self.dead)

    def rank_stats(self) -> list[RankStats]:
        """Every rank's RankStats, in rank order (between steps)."""
        if self.dead is not None:
            raise RanksFailed(self.dead)
        self.step_id += 1
        payload = pickle.dumps(("stats", self.step_id, None))
        for rank in range(self.layout.world_size):
            self.sock.send_multipart([f"rank{rank}".encode(), payload])
        stats: dict[int, RankStats] = {}
        deadline = time.monotonic() + self.args.distributed_timeout_s
        while len(stats) < self.layout.world_size:
            kind, step, rank, value = self._receive(deadline, "a stats request")
            if kind == "stats" and step == self.step_id:
                stats[rank] = value
        return [stats[r] for r in range(self.layout.world_size)]

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
    sock.close(linger=0)
    ctx.term()


class ReplicaRunner:
    """What EngineCore sees of DP replica d's ranks: their agreed cache layout and (data_parallel_size 1
    only) execute(). With several replicas, DPEngineCore steps them all through Executor.execute at once."""

    def __init__(self, executor: Executor, replica: int):
        self.executor, self.replica = executor, replica
        self.layout, self.replay_tokens = executor.cache_layout, executor.replay_tokens
        self.scheduler = None  # the replica's Scheduler, set once its EngineCore exists

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.executor.execute([(out, set(self.scheduler.requests))])[0]

    def close(self) -> None:
        self.executor.close()
