"""One process per rank on this machine, with bounded-time failure detection and no orphans.

`WorkerGroup(target, parallel, args)` spawns world_size processes; each joins the process group (through the
rendezvous store the parent hosts on a loopback port, and the same environment variables torchrun sets) and runs
`target(rank, layout, *args)`, an importable top-level function. Its return value comes back through `wait()`;
afterwards the worker idles until `close()`.

Two pipes per worker: control (parent -> worker: "stop"; EOF means the parent is gone) and report
(worker -> parent: heartbeats, the result or the traceback). A monitor thread in the parent reads every report
pipe and process sentinel and records, per rank, the first failure: a death (with its exit code), a raised
exception, or a hang (no heartbeat for `hang_timeout_s`). Collective stalls are bounded by the process-group
timeout (`pg_timeout_s`): the waiting ranks raise, and that is reported like any exception.
"""

from __future__ import annotations

import _thread
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from deepinfer.config import ParallelConfig
from deepinfer.distributed.backend import DistEnv, init_from_env
from deepinfer.distributed.layout import RankLayout, make_layout

logger = logging.getLogger(__name__)

EXIT_ERROR = 1  # the target raised (the traceback was reported first)
EXIT_PARENT_GONE = 3  # the owner process died or closed the control pipe


@dataclass(frozen=True)
class WorkerOptions:
    pg_timeout_s: float = 60.0  # store and every collective fail after this instead of hanging
    heartbeat_s: float = 0.5  # a worker reports it is alive this often
    hang_timeout_s: float = 30.0  # no heartbeat for this long: the rank is reported hung
    startup_timeout_s: float = 120.0  # the first heartbeat (interpreter + torch import) must come within this
    join_timeout_s: float = 5.0  # close(): how long workers get to exit before SIGKILL
    master_addr: str = "127.0.0.1"

    def __post_init__(self):
        for name in ("pg_timeout_s", "heartbeat_s", "hang_timeout_s", "startup_timeout_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hang_timeout_s <= self.heartbeat_s:
            raise ValueError("hang_timeout_s must be longer than heartbeat_s")


class WorkerFailure(RuntimeError):
    """One or more ranks died, raised or hung; `failures` maps each such rank to what happened."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        super().__init__("; ".join(f"rank {r}: {why}" for r, why in self.failures.items()))


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it); rank 0's store binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


# ----------------------------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class _Job:
    """Everything one worker needs; pickled into the spawned process (the target by its import path)."""

    target: Callable[..., Any]
    args: tuple
    layout: RankLayout
    env: DistEnv
    options: WorkerOptions
    parent_pid: int


class _Reporter:
    """Worker -> parent messages. The heartbeat thread and the main thread both send, hence the lock; a broken
    pipe means the parent is gone, and a worker without a parent exits at once."""

    def __init__(self, conn: mpc.Connection):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, kind: str, payload: Any = None) -> None:
        with self._lock:
            try:
                self._conn.send((kind, payload))
            except OSError:
                os._exit(EXIT_PARENT_GONE)


class _WorkerState:
    def __init__(self):
        self.running = True  # the target has not returned yet
        self.stop = threading.Event()


def _heartbeat(reporter: _Reporter, job: _Job) -> None:
    while True:
        if os.getppid() != job.parent_pid:  # reparented: the owner died (a backup for the pipe EOF)
            os._exit(EXIT_PARENT_GONE)
        reporter.send("beat")
        time.sleep(job.options.heartbeat_s)


def _watch_parent(ctrl: mpc.Connection, state: _WorkerState) -> None:
    """EOF on the control pipe (the owner died or closed it) ends the worker at once; "stop" asks the main
    thread to finish, interrupting the target if it is still running."""
    while True:
        try:
            ctrl.recv()
        except (EOFError, OSError):
            os._exit(EXIT_PARENT_GONE)
        state.stop.set()
        if state.running:
            _thread.interrupt_main()


def _start_daemon(fn: Callable[..., None], *args: Any) -> None:
    threading.Thread(target=fn, args=args, daemon=True).start()


def _run_target(job: _Job, reporter: _Reporter, state: _WorkerState) -> None:
    os.environ.update(job.env.to_environ())
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the parent hosts the store, as torchrun's agent does
    init_from_env(job.options.pg_timeout_s)
    result = job.target(job.env.rank, job.layout, *job.args)
    state.running = False
    reporter.send("done", result)
    state.stop.wait()


def _exit(code: int) -> None:
    """Leave now, skipping interpreter teardown (torch's takes ~1 s); what the target printed still shows."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker_main(job: _Job, ctrl: mpc.Connection, report: mpc.Connection) -> None:
    state, reporter = _WorkerState(), _Reporter(report)
    _start_daemon(_watch_parent, ctrl, state)
    _start_daemon(_heartbeat, reporter, job)
    try:
        _run_target(job, reporter, state)
    except KeyboardInterrupt:
        if not state.stop.is_set():
            reporter.send("error", traceback.format_exc())
            _exit(EXIT_ERROR)
    except BaseException:
        # exit at once: peers blocked on this rank then fail fast (closed sockets) instead of timing out
        reporter.send("error", traceback.format_exc())
        _exit(EXIT_ERROR)
    if dist.is_initialized():
        dist.destroy_process_group()
    _exit(0)


# ----------------------------------------------------------------------------------------------- parent side


class _Supervisor:
    """Owns the processes and pipes. The monitor thread and the finalizer reference this, never the WorkerGroup,
    so dropping the last WorkerGroup reference still runs the finalizer (and closes the workers)."""

    def __init__(self, procs: list, ctrls: list, reports: list, options: WorkerOptions,
                 on_failure: Callable[[WorkerFailure], None] | None):
        self.procs, self.ctrls, self.reports, self.options = procs, ctrls, reports, options
        self.on_failure = on_failure
        self.reported: set[int] = set()  # ranks whose failure was logged and passed to on_failure
        self.results: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.started = time.monotonic()
        self.last_beat: dict[int, float] = {}
        self.open = set(range(len(procs)))  # ranks whose report pipe has not hit EOF
        self.exited: set[int] = set()
        self.hung: set[int] = set()  # no grace at close(): they would not act on "stop"
        self.changed = threading.Condition()
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._monitor, daemon=True, name="deepinfer-worker-monitor")
        self.thread.start()

    def _monitor(self) -> None:
        waitables = [p.sentinel for p in self.procs] + self.reports
        while not self.closing.is_set():
            mpc.wait(waitables, timeout=min(self.options.heartbeat_s, 0.2))
            with self.changed:
                self._poll(time.monotonic())
                self.changed.notify_all()
                new = {r: why for r, why in self.failures.items() if r not in self.reported}
                self.reported.update(new)
            if new:
                self._report(WorkerFailure(new))

    def _report(self, failure: WorkerFailure) -> None:
        """Runs on the monitor thread, outside the lock, once per newly failed rank(s)."""
        logger.error("worker failure: %s", failure)
        try:
            if self.on_failure is not None:
                self.on_failure(failure)
        except Exception:
            logger.exception("on_failure callback raised")  # the monitor must keep running

    def _poll(self, now: float) -> None:
        """Reports are drained before deaths are looked at, so a rank's traceback comes before its exit code."""
        for rank in sorted(self.open):
            self._drain(rank, now)
        for rank, proc in enumerate(self.procs):
            self._note_exit(rank, proc.exitcode)
            self._check_alive(rank, now)

    def _note_exit(self, rank: int, code: int | None) -> None:
        """Any exit before close() is a failure: a worker that finished idles until it is told to stop."""
        if code is None or self.closing.is_set() or rank in self.exited:
            return
        self.exited.add(rank)
        death = f"died with {describe_exit(code)}"
        self.failures[rank] = f"{self.failures[rank]}\n({death})" if rank in self.failures else death

    def _drain(self, rank: int, now: float) -> None:
        conn = self.reports[rank]
        try:
            while conn.poll():
                self._receive(rank, *conn.recv(), now)
        except (EOFError, OSError):
            self.open.discard(rank)

    def _receive(self, rank: int, kind: str, payload: Any, now: float) -> None:
        self.last_beat[rank] = now
        if kind == "done":
            self.results[rank] = payload
        elif kind == "error":
            self._fail(rank, f"raised:\n{payload}")

    def _check_alive(self, rank: int, now: float) -> None:
        if rank not in self.last_beat:
            if now - self.started > self.options.startup_timeout_s:
                self._fail(rank, f"did not start within {self.options.startup_timeout_s} s (no heartbeat)")
        elif now - self.last_beat[rank] > self.options.hang_timeout_s and rank not in self.exited:
            self.hung.add(rank)
            self._fail(rank, f"stopped responding: no heartbeat for {now - self.last_beat[rank]:.1f} s")

    def _fail(self, rank: int, why: str) -> None:
        self.failures.setdefault(rank, why)  # the first failure of a rank is its cause

    def close(self) -> None:
        """Ask every worker to stop, give them join_timeout_s, SIGKILL the rest (this also ends SIGSTOPped ones)."""
        self.closing.set()
        self.thread.join(timeout=5.0)
        for rank in self.hung:
            _kill(self.procs[rank])
        for conn in self.ctrls:
            _send_quietly(conn, "stop")
        deadline = time.monotonic() + self.options.join_timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            _kill(proc)
        for conn in self.ctrls + self.reports:
            conn.close()


def _send_quietly(conn: mpc.Connection, msg: str) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass  # that worker is already gone


def _kill(proc: mp.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5.0)


def _spawn(ctx: mp.context.BaseContext, job: _Job) -> tuple:
    """Start one worker; the parent keeps only its own pipe ends (so a dead side shows as EOF on the other)."""
    ctrl_r, ctrl_w = ctx.Pipe(duplex=False)
    report_r, report_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker_main, args=(job, ctrl_r, report_w), daemon=True,
                       name=f"deepinfer-rank{job.env.rank}")
    proc.start()
    ctrl_r.close()
    report_w.close()
    return proc, ctrl_w, report_r


class WorkerGroup:
    """world_size worker processes running `target(rank, layout, *args)`; see the module docstring.
    `on_failure(WorkerFailure)` is called from the monitor thread as soon as ranks fail (and they are logged);
    it must not call close() itself (close joins that thread), only signal the owner.

    `close()` is idempotent and also runs from a weakref finalizer (when the group is garbage collected) and at
    interpreter exit (weakref.finalize's atexit hook); workers also exit by themselves when this process dies."""

    def __init__(self, target: Callable[..., Any], parallel: ParallelConfig, args: tuple = (),
                 options: WorkerOptions | None = None, on_failure: Callable[[WorkerFailure], None] | None = None):
        self.layout = make_layout(parallel)
        self.options = options or WorkerOptions()
        # The parent hosts the rendezvous store on a port the OS gives it while bound: no window in which another
        # process could take a port picked for rank 0 (ranks connect as clients, like torchrun's workers).
        self._store = dist.TCPStore(self.options.master_addr, 0, self.layout.world_size, is_master=True,
                                    timeout=timedelta(seconds=self.options.pg_timeout_s), wait_for_workers=False)
        self.port = self._store.port
        spawned = self._spawn_all(target, tuple(args))
        procs, ctrls, reports = (list(x) for x in zip(*spawned))
        self._sup = _Supervisor(procs, ctrls, reports, self.options, on_failure)
        self._finalizer = weakref.finalize(self, self._sup.close)
        self._finalizer.atexit = True

    def _spawn_all(self, target: Callable[..., Any], args: tuple) -> list[tuple]:
        ctx, spawned = mp.get_context("spawn"), []
        try:
            for rank in range(self.layout.world_size):
                env = DistEnv(rank, self.layout.world_size, self.options.master_addr, self.port, local_rank=rank)
                spawned.append(_spawn(ctx, _Job(target, args, self.layout, env, self.options, os.getpid())))
        except BaseException:
            for proc, *_ in spawned:
                _kill(proc)
            raise
        return spawned

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._sup.procs]

    @property
    def failures(self) -> dict[int, str]:
        with self._sup.changed:
            return dict(self._sup.failures)

    def check(self) -> None:
        """Raise WorkerFailure if any rank died, raised or hung (as seen by the monitor, at most ~0.2 s ago)."""
        failures = self.failures
        if failures:
            raise WorkerFailure(failures)

    def wait(self, timeout_s: float) -> list[Any]:
        """Every rank's return value, in rank order. Raises WorkerFailure as soon as a rank fails, TimeoutError
        after `timeout_s`; never blocks longer."""
        deadline, sup = time.monotonic() + timeout_s, self._sup
        with sup.changed:
            while len(sup.results) < len(sup.procs):
                left = deadline - time.monotonic()
                if sup.failures:
                    raise WorkerFailure(sup.failures)
                if left <= 0 or sup.closing.is_set():
                    raise TimeoutError(f"ranks {sorted(set(range(len(sup.procs))) - set(sup.results))} did not "
                                       f"finish within {timeout_s} s")
                sup.changed.wait(timeout=left)
            return [sup.results[r] for r in range(len(sup.procs))]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
