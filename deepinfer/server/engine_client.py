"""AsyncEngineClient: the API process's asyncio handle on the engine process.

The client binds one PUSH socket (requests) and one PULL socket (outputs) and spawns
`deepinfer.engine.engine_proc.run_engine`, which connects to both. Three background tasks own the
I/O: a sender (the only user of the PUSH socket), a receiver (the only user of the PULL socket) that
routes each EngineOutput to its parent request's asyncio.Queue, and a watchdog for the process.
Every method must be called from the event loop that ran `start()`.

Invariants:
- `_streams` holds exactly the requests whose generator is still open;
- a stream's `unfinished` holds the sample indices whose final output has not been queued yet, and
  nothing is queued for an index after its final output, so each sample ends exactly once;
- once the engine is dead (or the client shut down), every open stream has a final output per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from deepinfer.config import EngineArgs
from deepinfer.engine.engine_proc import run_engine
from deepinfer.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineStats,
    RequestError,
    ResetPrefixCache,
    Shutdown,
    decode_output,
    encode,
    params_to_dict,
)
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")

WATCHDOG_INTERVAL_S = 0.1
STOP_GRACE_S = 5.0  # after a graceful stop times out: how long terminate, then kill, may take


class EngineDeadError(RuntimeError):
    """The engine process is gone (crashed, killed or shut down); no new request can run."""


class ReplicaLost(EngineDeadError):
    """The engine replica running a request was lost (--data-parallel-replicas); the other replicas serve on."""


def request_cost(num_prompt_tokens: int, params: SamplingParams) -> int:
    """A request's weight in a router's load signal: its prompt plus every sample's output budget (tokens)."""
    return num_prompt_tokens + params.n * (params.max_tokens or 0)


@dataclass
class _Stream:
    request_id: str
    unfinished: set[int]
    num_prompt_tokens: int
    cost: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngineClient:
    def __init__(self, process, ctx: zmq.asyncio.Context, to_engine: zmq.asyncio.Socket,
                 from_engine: zmq.asyncio.Socket, ready: EngineReady, tmpdir: str | None):
        """Use `await AsyncEngineClient.start(...)`; this only wires up a started engine."""
        self.process = process
        self.ready = ready
        self.dead = False
        self.dead_reason: str | None = None
        self.dead_event = asyncio.Event()
        self.closed = False
        self._ctx, self._to_engine, self._from_engine, self._tmpdir = ctx, to_engine, from_engine, tmpdir
        self._streams: dict[str, _Stream] = {}
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._stats: EngineStats | None = None
        self.load_tokens = 0  # request_cost of every open stream: what `deepinfer router` balances on
        self.on_kv_events = None  # called with each message's prefix-cache events (engine option kv_events)
        self.last_message = time.monotonic()  # the engine sends stats at least every ~0.25 s: a heartbeat
        self._watchdog_task = asyncio.create_task(self._watchdog())
        self._io_tasks = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._receive_loop())]

    # --- start / stop ----------------------------------------------------------------------------
    @classmethod
    async def start(cls, model: str | None, engine_kwargs: dict, startup_timeout: float | None = None,
                    transport: str = "ipc") -> AsyncEngineClient:
        """Spawn the engine and wait for it to load; RuntimeError (with the engine's reason) if it cannot.
        startup_timeout: default startup_allowance(engine_kwargs)."""
        startup_timeout = startup_allowance(engine_kwargs) if startup_timeout is None else startup_timeout
        ctx = zmq.asyncio.Context()
        tmpdir = tempfile.mkdtemp(prefix="deepinfer-") if _use_ipc(transport) else None
        process = None
        try:
            to_engine, input_addr = _bind(ctx, zmq.PUSH, tmpdir, "input")
            from_engine, output_addr = _bind(ctx, zmq.PULL, tmpdir, "output")
            process = _spawn(model, engine_kwargs, input_addr, output_addr)
            ready = await _await_ready(process, from_engine, startup_timeout)
        except BaseException:
            if process is not None:
                await _stop_process(process, 0.0)
            _release(ctx, tmpdir)
            raise
        return cls(process, ctx, to_engine, from_engine, ready, tmpdir)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (gracefully, then terminate/kill) and release everything; idempotent.

        Open generators end with an "error" output. `dead_event` is not set by a shutdown.
        """
        if self.closed:
            return
        self.closed = True
        self._watchdog_task.cancel()
        self._fail_streams("the engine is shutting down")
        self._post(Shutdown())
        try:
            await _stop_process(self.process, timeout)
        finally:  # even when cancelled meanwhile: a context left to the GC blocks in term()
            for task in [self._watchdog_task, *self._io_tasks]:
                task.cancel()
            _release(self._ctx, self._tmpdir)
        await asyncio.gather(self._watchdog_task, *self._io_tasks, return_exceptions=True)

    # --- requests --------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       kv_transfer: dict | None = None, images: list | None = None) -> AsyncIterator[EngineOutput]:
        """Yield this request's EngineOutputs (all n samples, interleaved) until every sample finished.

        Raises ValueError if the engine rejects the request (or the id is in flight), RuntimeError if the
        engine failed to queue it, EngineDeadError if the engine is gone before it starts. If the engine
        dies (or the client shuts down) meanwhile, each unfinished sample ends with finish_reason "error".
        Closing the generator early (aclose, cancellation, garbage collection) aborts the request.
        Request ids must be unique over the client's life: a reused id may receive late outputs of
        an aborted predecessor. Requests with different `cache_salt`s never share cached prefix blocks.
        `images`: the prompt's image spans (multimodal.inputs.ImageSpan), placeholders already expanded.
        """
        stream = self._open(request_id, prompt_token_ids, params, priority, cache_salt, kv_transfer, images)
        try:
            while stream.unfinished or not stream.queue.empty():
                item = await stream.queue.get()
                if isinstance(item, RequestError):
                    raise (ValueError if item.status == 400 else RuntimeError)(item.message)
                yield item
        finally:
            self._close_stream(stream)

    def _open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              priority: int, cache_salt: str | None = None, kv_transfer: dict | None = None,
              images: list | None = None) -> _Stream:
        if self.dead or self.closed:
            raise EngineDeadError(self.dead_reason or "the engine client is shut down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        data = _encode_add(request_id, prompt_token_ids, params, priority, cache_salt, kv_transfer, images)
        cost = request_cost(len(prompt_token_ids), params)
        stream = self._streams[request_id] = _Stream(request_id, set(range(params.n)), len(prompt_token_ids), cost)
        self.load_tokens += cost
        self._outbox.put_nowait(data)
        return stream

    def _close_stream(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self.load_tokens -= stream.cost
        if stream.unfinished:  # closed early: the engine still runs it
            stream.unfinished.clear()
            self._post(AbortRequest([stream.request_id]))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its open generator (if any) ends with "abort" outputs."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._finish_stream(stream, "abort", None)
        self._post(AbortRequest([request_id]))

    def abort_all(self) -> None:
        """Abort every open request (the drain ran out): each open generator ends with "abort" outputs."""
        ids = list(self._streams)
        for stream in self._streams.values():
            self._finish_stream(stream, "abort", None)
        if ids:
            self._post(AbortRequest(ids))

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stop one sample of an n > 1 request (its choice ended on a stop string); the stream goes on
        with the other samples and ends when they do."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.unfinished.discard(index)
        self._post(AbortRequest([request_id], sample_index=index))

    def reset_prefix_cache(self) -> None:
        self._post(ResetPrefixCache())

    # --- state -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats | None:
        """The latest stats the engine sent (every ~0.25 s while busy, and when it becomes idle)."""
        return self._stats

    def engine_stats(self) -> dict[str, EngineStats | None]:
        """The stats by the engine's label in /metrics."""
        return {"0": self._stats}

    def collectors(self) -> list:
        """More Prometheus collectors for /metrics (a router's, for several engines; none for one)."""
        return []

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # --- background tasks ------------------------------------------------------------------------
    def _post(self, message) -> None:
        """Queue a message for the sender task (harmless once the engine is gone: nothing reads it)."""
        self._outbox.put_nowait(encode(message))

    async def _send_loop(self) -> None:
        while True:
            data = await self._outbox.get()
            await self._to_engine.send(data)

    async def _receive_loop(self) -> None:
        while True:
            data = await self._from_engine.recv()
            self.last_message = time.monotonic()
            try:
                self._dispatch(decode_output(data))
            except msgspec.DecodeError:
                logger.exception("dropping a malformed message from the engine")

    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineOutputs):
            self._stats = msg.stats or self._stats
            if msg.kv_events and self.on_kv_events is not None:
                self.on_kv_events(msg.kv_events)
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, RequestError):
            self._reject(msg)
        elif isinstance(msg, EngineFailure):
            self._mark_dead(f"the engine failed: {msg.message}")

    def _deliver(self, out: EngineOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None or out.index not in stream.unfinished:
            return  # closed, aborted or already failed: late outputs are dropped
        if out.finished:
            stream.unfinished.discard(out.index)
        stream.queue.put_nowait(out)

    def _reject(self, error: RequestError) -> None:
        stream = self._streams.get(error.request_id)
        if stream is not None:
            stream.unfinished.clear()  # the engine queued nothing
            stream.queue.put_nowait(error)

    async def _watchdog(self) -> None:
        while self.process.exitcode is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        self._mark_dead(f"the engine process exited unexpectedly (exit code {self.process.exitcode})")

    def fail(self, reason: str) -> None:
        """Give the engine up (it hangs): fail its requests now and stop its process (so it cannot come back)."""
        self._mark_dead(reason)
        if self.process.exitcode is None:
            self.process.kill()

    def _mark_dead(self, reason: str) -> None:
        if self.dead or self.closed:
            return
        self.dead, self.dead_reason = True, reason
        logger.error("%s", reason)
        self._fail_streams(reason)
        self.dead_event.set()

    def _fail_streams(self, reason: str) -> None:
        for stream in self._streams.values():
            self._finish_stream(stream, "error", reason)

    @staticmethod
    def _finish_stream(stream: _Stream, finish_reason: str, error: str | None) -> None:
        """Queue a final output for every unfinished sample of the stream."""
        for index in sorted(stream.unfinished):
            stream.queue.put_nowait(EngineOutput(stream.request_id, index, [], finish_reason=finish_reason,
                                                 num_prompt_tokens=stream.num_prompt_tokens, error=error))
        stream.unfinished.clear()


# --- helpers -------------------------------------------------------------------------------------
def _encode_add(request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                cache_salt: str | None = None, kv_transfer: dict | None = None, images: list | None = None) -> bytes:
    """Encode an AddRequest, turning what msgpack cannot carry into the ValueError a bad request gets."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {request_id}: sampling params must be SamplingParams, got {type(params)}")
    ids = list(prompt_token_ids)
    if not all(isinstance(t, int) for t in ids):
        raise ValueError(f"request {request_id}: prompt token ids must be ints")
    try:
        return encode(AddRequest(request_id, [int(t) for t in ids], params_to_dict(params), priority, time.time(),
                                 cache_salt, kv_transfer, [s.wire for s in images] if images else None))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"request {request_id}: {e}") from None


def _spawn(model: str | None, engine_kwargs: dict, input_addr: str, output_addr: str):
    """Start run_engine in a fresh interpreter ("spawn": no forked torch or event-loop state)."""
    level = logging.getLogger("deepinfer").getEffectiveLevel()
    # A multi-rank engine starts its rank processes itself, which a daemonic process may not; it still exits
    # with this process (run_engine watches its parent) and its ranks with it (they watch theirs).
    ranks = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("data_parallel_size", 1)
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine, args=(model, dict(engine_kwargs), input_addr, output_addr, os.getpid(), level),
        name="deepinfer-engine", daemon=ranks == 1)
    process.start()
    return process


def _use_ipc(transport: str) -> bool:
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"transport must be ipc or tcp, got {transport!r}")
    return transport == "ipc" and zmq.has("ipc")


def _bind(ctx: zmq.asyncio.Context, kind: int, tmpdir: str | None, name: str) -> tuple[zmq.asyncio.Socket, str]:
    """Bind a socket on ipc://<tmpdir>/<name>, or on a free loopback TCP port when tmpdir is None."""
    sock = ctx.socket(kind)
    if tmpdir is None:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return sock, f"tcp://127.0.0.1:{port}"
    addr = f"ipc://{os.path.join(tmpdir, name)}"
    sock.bind(addr)
    return sock, addr


LOAD_ALLOWANCE_S = 120.0  # interpreter, imports, checkpoint load
COMPILE_ALLOWANCE_S = 900.0  # compiling the decode steps cold (a minute or three on a small CPU machine)


def startup_allowance(engine_kwargs: dict) -> float:
    """How long an engine may take to report ready: loading, plus compiling unless it runs eagerly. An engine
    that dies meanwhile is noticed at once (its exit code), so only a hung start-up waits this long."""
    eager = engine_kwargs.get("enforce_eager", EngineArgs().enforce_eager)  # absent: EngineArgs' default
    return LOAD_ALLOWANCE_S + (0.0 if eager else COMPILE_ALLOWANCE_S)


async def _await_ready(process, sock: zmq.asyncio.Socket, timeout: float) -> EngineReady:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await sock.poll(100):
            return _ready_or_raise(decode_output(await sock.recv()))
        if process.exitcode is not None:
            if await sock.poll(500):  # its failure report may still be in flight
                return _ready_or_raise(decode_output(await sock.recv()))
            raise RuntimeError(f"the engine process exited with code {process.exitcode} during start-up")
    raise RuntimeError(f"the engine did not start within {timeout:g} s")


def _ready_or_raise(msg) -> EngineReady:
    if isinstance(msg, EngineReady):
        return msg
    if isinstance(msg, EngineFailure):
        raise RuntimeError(f"the engine failed to start: {msg.message}")
    raise RuntimeError(f"unexpected first message from the engine: {type(msg).__name__}")


async def _wait_exit(process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while process.exitcode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return process.exitcode is not None


async def _stop_process(process, timeout: float) -> None:
    """Wait `timeout` for the process to exit by itself, then terminate, then kill; reaps it."""
    if await _wait_exit(process, timeout):
        return
    process.terminate()
    if not await _wait_exit(process, STOP_GRACE_S):
        process.kill()
        await _wait_exit(process, STOP_GRACE_S)


def _release(ctx: zmq.asyncio.Context, tmpdir: str | None) -> None:
    ctx.destroy(linger=0)
    if tmpdir is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmpdir)
