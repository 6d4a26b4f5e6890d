"""The API's grammar check runs in worker processes, so a compile that overruns its time limit can be
stopped: xgrammar compiles in C++ and a thread running it can be neither cancelled nor reclaimed.

Invariants:
- at most `size` workers; each runs one check at a time and answers it with a verdict: (None, closing
  need) when the spec builds and compiles (the tokens the closing search needs from the grammar's
  start, stop token included; None without a tokenizer or when the search found none), else
  (the 400's reason, None);
- a check still running at its deadline (or whose request went away) is killed with its worker
  (SIGKILL) and the worker is replaced, so no abandoned compile holds a worker, a CPU or memory;
- a worker's address space is capped (its size once started + `memory_bytes`): a compile that needs
  more fails in that worker only;
- workers are forked from a fork server that imported xgrammar once, so a replacement starts in
  milliseconds; each builds the tokenizer info once and keeps xgrammar's compile cache;
- `close()` kills every worker, and a worker exits by itself once the API process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import resource
import threading
from typing import Any

logger = logging.getLogger("deepinfer")

READY = "ready"
START_TIMEOUT_S = 120.0  # a worker that is not ready by then failed to start
CACHE_BYTES = 64 * 2**20  # xgrammar's compiled-grammar cache, per worker


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["deepinfer.structured.backend"])  # xgrammar (and torch) import once
    return ctx


# --- the worker process ---------------------------------------------------------------------------
def _limit_memory(memory_bytes: int) -> None:
    """Caps the address space at its current size + memory_bytes (Linux: /proc gives the size)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = current + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _exit_with_parent() -> None:
    """A worker busy compiling does not read its pipe, so a thread watches the API process instead."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(0)), daemon=True).start()


Verdict = tuple[str | None, int | None]  # (reason it fails, or None; tokens closing needs from the start)


def _verdict(compiler, closer, fields: dict[str, Any]) -> Verdict:
    from deepinfer.structured import backend
    from deepinfer.structured.params import StructuredOutputsParams

    spec = StructuredOutputsParams.from_value(fields)
    try:
        grammar = backend.build_grammar(spec)
    except ValueError as e:
        return str(e), None
    if compiler is None:
        return None, None
    try:
        compiled = compiler.compile(grammar)
    except Exception as e:  # xgrammar's errors, ours (an empty language), or running out of memory
        return f"the {spec.kind} constraint failed to compile: {backend.reason(e)}", None
    closing = closer.closing(backend.new_matcher(compiled))
    return None, None if closing is None else len(closing) + 1


def _serve(conn, tokenizer, vocab_size: int, stop_token_ids: list[int], memory_bytes: int) -> None:
    """Worker main: tokenizer info once, then one verdict per spec received, until the pipe closes."""
    _exit_with_parent()
    from deepinfer.structured import backend
    from deepinfer.structured.closing import closer_for

    compiler = closer = None  # no tokenizer: only building is checked (the engine answers the rest)
    if tokenizer is not None:
        info = backend.tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        compiler = backend.Compiler(info, cache_bytes=CACHE_BYTES)
        closer = closer_for(tokenizer, info, vocab_size, stop_token_ids)
    _limit_memory(memory_bytes)
    conn.send(READY)
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while True:
            conn.send(_verdict(compiler, closer, conn.recv()))


# --- the API side -----------------------------------------------------------------------------------
class WorkerGone(Exception):
    """The worker exited before answering (it crashed, or ran out of memory)."""


class _Worker:
    def __init__(self, ctx, args: tuple):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, *args), daemon=True, name="deepinfer-grammar")
        self.proc.start()  # blocking (it talks to the fork server): called in a thread
        child.close()

    async def ask(self, fields: dict[str, Any], timeout_s: float) -> Verdict:
        """The worker's verdict on one spec; TimeoutError past timeout_s, WorkerGone if it exited."""
        try:
            self.conn.send(fields)
        except OSError:
            raise self._gone() from None
        return await self.receive(timeout_s)

    async def receive(self, timeout_s: float):
        """The worker's next message; TimeoutError if none within timeout_s, WorkerGone if it exited."""
        await _readable(self.conn.fileno(), timeout_s)
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None

    def _gone(self) -> WorkerGone:
        self.proc.join(0.05)  # it closed its pipe: it is exiting (never block the event loop for long)
        return WorkerGone(f"the compiler process exited (status {self.proc.exitcode})")

    def kill(self, wait: bool = True) -> None:
        """SIGKILL, then reap: here (`wait`, at shutdown: gone on return) or on a daemon thread, so a request's
        event loop never waits for a large worker's memory to be freed."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.kill()
            self.conn.close()
        if wait:
            self.proc.join(1)
        else:
            threading.Thread(target=self.proc.join, daemon=True, name="deepinfer-grammar-reaper").start()


async def _readable(fd: int, timeout_s: float) -> None:
    """Waits, on the event loop (no thread), until `fd` can be read (a message or EOF)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, max(timeout_s, 0.0))
    finally:
        loop.remove_reader(fd)


class CompilePool:
    """`size` worker processes, started with the first check. Use from one event loop."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], size: int = 2,
                 memory_bytes: int = 4 * 2**30):
        self._args = (tokenizer, vocab_size, list(stop_token_ids), memory_bytes)
        self.size = size
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        self._starting: set[asyncio.Task] = set()
        self._started = asyncio.Event()  # a first worker was ready (or starting failed: see _failure)
        self._failure: str | None = None
        self.closed = False

    async def verdict(self, fields: dict[str, Any], timeout_s: float) -> Verdict:
        """A worker's verdict on the spec. The time limit covers waiting for a free worker and the check,
        not the pool's first start (importing xgrammar takes seconds); TimeoutError past it."""
        await self._wait_started()
        deadline = asyncio.get_running_loop().time() + timeout_s
        worker = await asyncio.wait_for(self._idle.get(), timeout_s)
        try:
            result = await worker.ask(fields, deadline - asyncio.get_running_loop().time())
        except BaseException:  # timed out, the request went away, or the worker died: never reuse it
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return result

    async def _wait_started(self) -> None:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.size):
                self._start_worker()
        await self._started.wait()
        if self._failure is not None and not self._workers:
            raise RuntimeError(f"the grammar compiler could not start: {self._failure}")

    def _start_worker(self) -> None:
        task = asyncio.get_running_loop().create_task(self._add_worker())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _add_worker(self) -> None:
        worker = None
        try:
            worker = await asyncio.to_thread(_Worker, _context(), self._args)
            self._workers.add(worker)
            if await worker.receive(START_TIMEOUT_S) != READY:
                raise WorkerGone("the compiler process did not report ready")
            self._idle.put_nowait(worker)
        except Exception as e:
            logger.error("a grammar compiler process failed to start: %s", e)
            self._failure = str(e) or type(e).__name__
            if worker is not None:
                self._workers.discard(worker)
                worker.kill(wait=False)
        finally:
            self._started.set()

    def _replace(self, worker: _Worker) -> None:
        worker.kill(wait=False)
        self._workers.discard(worker)
        if not self.closed:
            self._start_worker()

    def close(self) -> None:
        """Kills every worker (a compile in progress dies with its worker); idempotent."""
        self.closed = True
        for task in self._starting:
            task.cancel()
        for worker in list(self._workers):
            worker.kill()
        self._workers.clear()
