"""Engine side of structured outputs: compile on admission in a thread pool (with a compiled-grammar
cache keyed by the spec and a time limit), one matcher per request (per sample with n > 1), and the
token bitmask of a step, filled on a worker thread while the forward runs.

Invariants:
- a request's matcher has accepted exactly its output tokens after the reasoning gate (the `</think>`
  token itself is not fed), so preemption (recompute) and prefix-cache hits leave it consistent: they
  recompute cache entries, never outputs;
- `rollback(k)` undoes the last k observed tokens exactly (speculative decoding rejects drafts with it);
- the bitmask is only read by the sampler after `result()`, and matchers only advance in the scheduler's
  update, after sampling: the fill thread and the engine loop never touch a matcher at the same time;
- compiles run on pool threads, never on the engine loop (xgrammar releases the GIL), so a slow one
  delays only constrained requests. A compile still queued at its request's deadline is cancelled, and
  a pool whose every thread runs past its deadline is replaced for later compiles (bounded:
  `_route_around_overruns`). The server checks every spec first, in a process killed at the same limit
  (server/grammar_workers.py), so the engine normally only compiles specs that compiled in time there;
  offline (`LLM`) a slow spec fails its request at the limit but holds a thread until it finishes.
- budget-aware: a row whose position is within `closing_margin` tokens of the shortest way to finish the
  grammar found (see `closing.py`) allows only the next closing token, so an output that still has the
  budget to finish does finish (with its stop token) instead of running out of tokens mid-structure.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer.structured import backend
from deepinfer.structured.closing import ClosingPlan, closer_for
from deepinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger("deepinfer")

THINK_END = "</think>"


class RequestGrammar:
    """One sample's matcher state. `ready()` is non-blocking; the scheduler admits the request once it
    is True and `error` is None."""

    def __init__(self, spec: StructuredOutputsParams, compiled: Future, timeout_s: float, think_end_id: int | None,
                 closing: ClosingPlan | None = None):
        self.spec, self._compiled, self.closing = spec, compiled, closing
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.think_end_id = think_end_id
        self.matcher = None
        self.error: str | None = None
        self.num_observed = 0  # output tokens seen (fed or not)
        # Observed-token count at which the constraint started; None while the model is still reasoning.
        self.gate: int | None = 0 if not spec.after_reasoning or think_end_id is None else None

    def ready(self) -> bool:
        if self.matcher is not None or self.error is not None:
            return True
        if self._compiled.done() and not self._compiled.cancelled():
            try:
                self.matcher = backend.new_matcher(self._compiled.result())
            except Exception as e:
                self.error = f"the {self.spec.kind} constraint failed to compile: {e}"
            return True
        if self._compiled.cancelled() or time.monotonic() > self.deadline:
            if time.monotonic() > getattr(self._compiled, "deadline", 0.0):  # no sharer still waits for it
                self._compiled.cancel()  # still queued: it never starts (a running compile cannot be stopped)
            self.error = f"the {self.spec.kind} constraint did not compile within {self.timeout_s:g} s"
            return True
        return False

    @property
    def constrains_next(self) -> bool:
        """The next sampled token must be masked."""
        return self.gate is not None and self.ready() and self.error is None and not self.matcher.is_terminated()

    @property
    def num_fed(self) -> int | None:
        """Tokens the matcher has accepted (None while the reasoning gate is closed)."""
        return None if self.gate is None else self.num_observed - self.gate

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it (state unchanged)."""
        if self.gate is None:
            self.num_observed += 1
            if token == self.think_end_id:
                self.gate = self.num_observed
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.num_observed += 1
        return True

    def rollback(self, k: int) -> None:
        """Forget the last k accepted tokens (a rejected `</think>` closes the gate again)."""
        if not 0 <= k <= self.num_observed:
            raise ValueError(f"cannot roll back {k} of {self.num_observed} tokens")
        target = self.num_observed - k
        if self.gate is not None:
            fed, keep = self.num_observed - self.gate, max(target - self.gate, 0)
            if fed > keep:
                self.matcher.rollback(fed - keep)
            if target < self.gate:  # the `</think>` that opened the gate is rolled back too
                self.gate = None
        self.num_observed = target

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts (state unchanged): the draft tokens speculative
        decoding may keep."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n


class StructuredOutputManager:
    MAX_OVERRUNS = 4  # overrunning compiles past which no fresh compile pool is started

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], timeout_s: float = 30.0,
                 max_workers: int = 2, cache_size: int = 256, closing_margin: int | None = 4):
        self.vocab_size, self.timeout_s, self.cache_size = vocab_size, timeout_s, cache_size
        info = backend.tokenizer_info(tokenizer, vocab_size, list(stop_token_ids))
        self.compiler = backend.Compiler(info, max_threads=max_workers)
        # closing searches run on the fill thread only (a Closer holds one scratch bitmask)
        self.closer = None if closing_margin is None else closer_for(tokenizer, info, vocab_size, list(stop_token_ids))
        self.closing_margin = closing_margin
        self._initial_closings: dict[tuple, list[int] | None] = {}  # spec key -> closing of the initial state
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self._grammars: OrderedDict[tuple, object] = OrderedDict()
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.max_workers = max_workers
        self._compile_pool = self._new_compile_pool()
        self._compiling: dict[Future, tuple] = {}  # compile -> (its pool, its first request's deadline)
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-bitmask")
        self.num_compiles = 0

    # --- admission -------------------------------------------------------------------------------
    def validate(self, spec: StructuredOutputsParams):
        """The spec's grammar (cached by spec), or ValueError with the reason."""
        key = spec.key()
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        grammar = backend.build_grammar(spec)
        self._remember(self._grammars, key, grammar)
        return grammar

    def request_state(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher state; the grammar compiles in the pool unless the cache already has it."""
        key = spec.key()
        future = self._compiled.get(key)
        if future is None or future.cancelled():
            grammar = self.validate(spec)
            future = self._submit_compile(grammar)
            self._remember(self._compiled, key, future)
        else:
            self._compiled.move_to_end(key)
            future.deadline = max(future.deadline, time.monotonic() + self.timeout_s)  # the latest sharer's
        plan = None if self.closer is None else ClosingPlan(self.closer, self.closing_margin, self._initial_closings,
                                                            key)
        return RequestGrammar(spec, future, self.timeout_s, self.think_end_id, plan)

    def _submit_compile(self, grammar) -> Future:
        self._route_around_overruns()
        future = self._compile_pool.submit(self.compiler.compile, grammar)
        future.deadline = time.monotonic() + self.timeout_s  # cancelled only once every sharer's deadline passed
        self._compiling[future] = (self._compile_pool, time.monotonic() + self.timeout_s)
        future.add_done_callback(lambda f: self._compiling.pop(f, None))  # on a pool thread
        self.num_compiles += 1
        return future

    def _route_around_overruns(self) -> None:
        """When every thread of the pool runs a compile past its deadline (they cannot be stopped), new
        compiles go to a fresh pool; the old one ends when its compiles do. Invariant: fewer than
        MAX_OVERRUNS + max_workers overrunning compiles exist, so their CPU and memory stay bounded;
        past that, new compiles queue (and fail at their own deadline)."""
        now = time.monotonic()
        overrunning = [pool for f, (pool, deadline) in list(self._compiling.items()) if f.running() and deadline < now]
        if overrunning.count(self._compile_pool) >= self.max_workers and len(overrunning) < self.MAX_OVERRUNS:
            self._compile_pool.shutdown(wait=False)
            self._compile_pool = self._new_compile_pool()

    def _new_compile_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.max_workers, thread_name_prefix="deepinfer-grammar")

    def _remember(self, cache: OrderedDict, key: tuple, value) -> None:
        cache[key] = value
        while len(cache) > self.cache_size:
            cache.popitem(last=False)

    # --- one step --------------------------------------------------------------------------------
    def fill_async(self, requests: Sequence, drafts: dict[str, list[int]] | None = None) -> Future | None:
        """Future of (row keys, int32 bitmask [K, ceil(V/32)]) for the requests among `requests` whose next
        token is constrained; None (nothing to do, nothing paid) when there are none. A request verifying
        d drafts gets d + 1 consecutive rows keyed by its id: row j is its mask after drafts[:j]."""
        constrained = _constrained(requests)
        return self._fill_pool.submit(self._fill, constrained, drafts or {}) if constrained else None

    def fill(self, requests: Sequence, drafts: dict[str, list[int]] | None = None):
        """The same, computed now on the calling thread."""
        constrained = _constrained(requests)
        return self._fill(constrained, drafts or {}) if constrained else None

    def _fill(self, requests: list, drafts: dict[str, list[int]]) -> tuple[list[str], torch.Tensor]:
        keys = [r.request_id for r in requests for _ in range(len(drafts.get(r.request_id, ())) + 1)]
        bitmask = backend.allocate_bitmask(len(keys), self.vocab_size)
        row = 0
        for req in requests:
            remaining = req.max_output_tokens - len(req.output_token_ids)  # this token included
            row = _fill_rows(req.grammar, drafts.get(req.request_id, []), bitmask, row, remaining)
        return keys, bitmask

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False)


def _fill_rows(grammar: RequestGrammar, drafts: list[int], bitmask: torch.Tensor, row: int,
               remaining: int) -> int:
    """Rows row..row+len(drafts) of `bitmask`: the mask before each draft and after the last, advancing
    the matcher through the drafts and rolling it back (the update advances it by what is accepted).
    After a draft that completes the grammar every token is allowed: the request stops at that draft.
    Row j's position may still generate `remaining - j` tokens; near that end it allows only closing."""
    accepted = 0
    for j in range(len(drafts) + 1):
        if grammar.terminated:
            bitmask[row + j] = -1
        else:
            _fill_row(grammar, bitmask, row + j, remaining - j)
        if j < len(drafts) and grammar.accept(drafts[j]):
            accepted += 1
    grammar.rollback(accepted)
    return row + len(drafts) + 1


def _fill_row(grammar: RequestGrammar, bitmask: torch.Tensor, row: int, remaining: int) -> None:
    """One mask row: the grammar's, or only the next closing token near the end of the budget."""
    plan = grammar.closing
    forced = None if plan is None else plan.forced(grammar.matcher, remaining, at_start=grammar.num_fed == 0)
    if forced is None:
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
        return
    bitmask[row] = 0
    for token in forced:  # bit 31 is the int32 sign bit
        bit = token % 32
        bitmask[row, token // 32] |= -(2**31) if bit == 31 else 1 << bit


def _constrained(requests: Sequence) -> list:
    return [r for r in requests if r.grammar is not None and r.grammar.constrains_next]
