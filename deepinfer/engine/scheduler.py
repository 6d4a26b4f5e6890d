"""Token-budget scheduler. There are no prefill or decode phases: every running request has
`num_computed_tokens` catching up to `num_tokens`, and each step hands out at most
`max_num_batched_tokens` new tokens over at most `max_num_seqs` requests. Chunked prefill,
decode, recompute after preemption and forked samples are all that one rule. Speculative drafts are
extra tokens of a decoding request in the same budget; rejected ones are rolled back by lowering
`num_computed_tokens` (every cache kind is position-indexed, so recomputing overwrites them).

Invariants: a running request holds blocks for every position it computes this step and a state
slot; a waiting request holds nothing; a finished request holds nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from deepinfer.config import SchedulerConfig, SpeculativeConfig
from deepinfer.engine.kv_cache import KVCacheManager, chain_hashes, prompt_digest
from deepinfer.engine.outputs import KVLoad, RunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.spec.policy import SpeculationGate, StepTimeProfile, choose_verify_lengths
from deepinfer.spec.stats import SpecDecodeStats


def admission_key(request: Request, policy: str) -> tuple:
    """Order of the waiting queue: arrival (fcfs), or priority then arrival (lower value first)."""
    if policy == "priority":
        return (request.priority, request.arrival_time)
    return (request.arrival_time,)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, replay_tokens: int = 0,
                 speculative: SpeculativeConfig | None = None):
        self.config, self.kv, self.max_model_len = config, kv, max_model_len
        self.speculative = speculative
        # Positions past a step's tokens that hold blocks: a draft model writes its chained drafts there.
        self.lookahead = speculative.num_speculative_tokens if speculative else 0
        self.spec_stats = SpecDecodeStats()
        self.step_profile = StepTimeProfile()  # EngineCore records (batched tokens, seconds) of every step
        # Called as f(request, rejected draft tokens) when verification rejects drafts (e.g. grammar rollback).
        self.rejection_listeners: list[Callable[[Request, list[int]], None]] = []
        self._verify_lens: dict[str, int] = {}
        # adaptive: draft only while it is predicted to beat plain decoding
        self.gate = SpeculationGate(self.lookahead or 1)
        self.forced_drafting: bool | None = None  # set only by the engine's start-up calibration
        # Tokens recomputed before a prefix-cache hit to rebuild bounded state (V4: layers * (window - 1)).
        self.replay_tokens = replay_tokens
        self.num_snapshot_restores = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> siblings waiting to fork
        self.num_preemptions = 0
        # Disaggregation. Decode: requests whose reserved blocks await their prompt cache; those whose read may
        # still write their blocks; aborted ones among them, freed when their read ends. Prefill: requests that
        # finished their prompt and first token this step and keep their cache for a decode engine (the engine
        # moves it to a hold right after the update).
        self.receiving: dict[str, Request] = {}
        self.loading: set[str] = set()
        self.orphaned: set[str] = set()
        self.sent: list[Request] = []

    # --- admission ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if request.fork_of is not None:
            self.pending_forks.setdefault(request.fork_of.request_id, []).append(request)
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if self.config.policy == "fcfs":
            self.waiting.append(request)
            return
        key = admission_key(request, self.config.policy)
        idx = next((i for i, r in enumerate(self.waiting) if admission_key(r, self.config.policy) > key),
                   len(self.waiting))
        self.waiting.insert(idx, request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.pending_forks or self.receiving)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: admission_key(r, "priority"))
        out.propose_drafts = self._drafting()
        self._verify_lens = self._plan_verify() if out.propose_drafts else {}
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # a step that had to preempt has no room to admit anyone
            self._schedule_waiting(out, budget)
        self._schedule_forks(out)
        self._schedule_snapshots(out)
        if self.config.async_scheduling:
            self._advance_scheduled(out)
        return out

    def _advance_scheduled(self, out: SchedulerOutput) -> None:
        """Async: scheduled tokens count as computed at once (steps run in order on one worker, so a later
        step always sees them) and each sampled token is pending until its step's update."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            s.request.num_pending += s.samples
        for child in out.fork_children:
            child.num_pending += 1

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._awaits_last_token(req):
                i += 1
                continue
            start = req.num_computed_tokens
            n = whole_images(req.image_keys, start, self._align(start, min(_scheduled_len(req) - start, budget)),
                             budget)
            if n == 0:  # an image span that does not fit this step's budget: a later step
                i += 1
                continue
            drafts = self._drafts(req, n, budget)
            if not self._allocate_or_preempt(req, n + len(drafts), out):
                continue  # req itself was preempted; self.running shrank
            out.scheduled.append(self._scheduled(req, n + len(drafts), drafts))
            budget -= n + len(drafts)
            i += 1
        return budget

    # --- speculation -------------------------------------------------------------------------
    def _plan_verify(self) -> dict[str, int]:
        """How many drafts each decoding request verifies this step (fixed: all of them)."""
        reqs = [r for r in self.running if r.spec_token_ids]
        fixed = self.speculative is None or self.speculative.verify_policy == "fixed"
        if not reqs or fixed or self.forced_drafting is not None:
            return {r.request_id: len(r.spec_token_ids) for r in reqs}
        empirical = self.spec_stats.acceptance_by_position()
        conf = [_confidence(r, empirical) for r in reqs]
        base = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        lengths = choose_verify_lengths(conf, self.step_profile, base)
        return {r.request_id: d for r, d in zip(reqs, lengths)}

    def _drafting(self) -> bool:
        """Fixed policy: always. Adaptive: while the gate predicts drafting faster than plain decoding (or as
        `forced_drafting` says, during the engine's calibration)."""
        if self.speculative is None or self.speculative.verify_policy != "adaptive":
            return True
        if self.forced_drafting is not None:
            return self.forced_drafting
        batch = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)  # after admission
        return self.gate.choose(batch)

    def steady_mode(self, out: SchedulerOutput) -> bool | None:
        """For a steady-state decode step (every request one token plus drafts), whether it drafted; None for
        other steps: prefill, or a switch between modes (drafting without verifying yet, or the reverse)."""
        if not out.scheduled or any(s.num_new_tokens - s.num_drafts != 1 for s in out.scheduled):
            return None
        if out.propose_drafts != any(s.num_drafts for s in out.scheduled):
            return None
        return out.propose_drafts

    def record_step(self, out: SchedulerOutput, result: RunnerOutput, seconds: float) -> None:
        """Measurements of a steady-state decode / verify step for the adaptive policy: step time by batched
        tokens and tokens emitted per request (drafting steps), and step time with and without drafting by
        batch size. The engine's calibration keeps its own measurements."""
        mode = self.steady_mode(out)
        if mode is None or self.forced_drafting is not None:
            return
        if mode:  # the verify cost of extra tokens, measured among drafting steps only
            self.step_profile.record(out.num_tokens, seconds)
            accepted = sum(len(result.accepted_drafts.get(s.request.request_id, ())) for s in out.scheduled)
            verified = sum(s.num_drafts for s in out.scheduled)
            self.gate.observe(len(out.scheduled), len(out.scheduled) + accepted, verified)
        self.gate.record(len(out.scheduled), mode, seconds)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts req verifies this step: only when decoding (one token behind), within the budget, the
        output cap and the model length; never for requests that return logprobs. A grammar keeps only the
        drafts it accepts, and none while it is not constraining yet (reasoning before `</think>`)."""
        if not req.spec_token_ids or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        if req.params.logprobs is not None:
            return []  # one logprob entry per step
        room = min(budget - 1, req.max_output_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens - 1, self._verify_lens.get(req.request_id, 0))
        drafts = req.spec_token_ids[:max(room, 0)]
        if req.grammar is None:
            return drafts
        return drafts[:req.grammar.valid_prefix(drafts)] if req.grammar.constrains_next else []

    def _allocate(self, req: Request, total: int, prefix: list[int] | None = None) -> bool:
        """Blocks for `total` positions plus the lookahead, never past what the request can ever hold
        (so a request alone always fits)."""
        cap = max(req.num_prompt_tokens + req.max_output_tokens, total)
        return self.kv.allocate(req.request_id, min(total + self.lookahead, cap), prefix)

    def _awaits_last_token(self, req: Request) -> bool:
        """Async: a request whose token in flight is its last by length rules, or that has nothing left to
        compute until that token arrives, is not scheduled (it finishes or resumes on the update)."""
        if not req.num_pending:
            return False
        n_out = len(req.output_token_ids) + req.num_pending
        return (n_out >= req.max_output_tokens or _scheduled_len(req) >= self.max_model_len
                or _scheduled_len(req) <= req.num_computed_tokens)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate for req, preempting the lowest-priority running requests (last first) as needed."""
        while not self._allocate(req, req.num_computed_tokens + n):
            victim = self._pick_victim()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _pick_victim(self) -> Request:
        """The last running request: latest arrival (fcfs) or lowest priority (running is sorted)."""
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the cache, keep the tokens, go back to the queue front."""
        self.kv.free(req.request_id)
        self.running.remove(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        req.num_computed_tokens = 0
        req.resume_point = 0
        req.spec_token_ids, req.spec_confidence = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            self._enqueue(req)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            req = self._first_ready()
            if req is None or req.num_pending:
                return  # grammars still compiling, or preempted with a token in flight: readmitted once known
            if req.receives_cache:
                if not self._reserve(req, out):
                    return
                continue
            prefix, start, restore = self._cached_prefix(req)
            n = whole_images(req.image_keys, start, self._align(start, min(req.num_tokens - start, budget)), budget)
            if n == 0:
                return  # its next image span needs more budget than this step has left
            # Without chunked prefill a prompt waits for a budget it fits in; one larger than any budget is chunked.
            fits_some_step = req.num_tokens - start <= self.config.max_num_batched_tokens
            if n < req.num_tokens - start and not self.config.enable_chunked_prefill and fits_some_step:
                return
            if not self._allocate(req, start + n, prefix):
                return
            self._resume_from(req, prefix, start, restore, out)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n

    # --- disaggregation ------------------------------------------------------------------------
    def _reserve(self, req: Request, out: SchedulerOutput) -> bool:
        """Decode engine: blocks for the prompt (a local prefix hit is shared, not read) and a state slot, then
        the request waits for its cache; it computes nothing until it arrives."""
        prefix = self._cached_prefix(req)[0]  # no replay: the bounded state comes with the cache
        if not self._allocate(req, req.num_tokens, prefix):
            return False
        if self._caches(req):
            self.kv.record_lookup(req.num_prompt_tokens, len(prefix) * self.kv.block_size)
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.receiving[req.request_id] = req
        self.loading.add(req.request_id)
        out.kv_loads.append(KVLoad(req.request_id, req.kv_transfer, req.num_tokens, prompt_digest(req.prompt_token_ids),
                                   list(self.kv.blocks[req.request_id]), self.kv.slots[req.request_id], len(prefix)))
        return True

    def remote_arrived(self, request_id: str, first_token: int, drafts: list[int]) -> Request | None:
        """The prompt cache is in place: the request has computed its prompt and sampled `first_token`."""
        req = self.receiving.pop(request_id, None)
        if req is None:
            return None  # aborted meanwhile
        req.num_computed_tokens = req.num_tokens
        req.kv_transfer = None  # consumed: a preempted request recomputes its cache here
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._append(req, [first_token], 0)
        req.spec_token_ids = [] if req.is_finished else list(drafts)
        return req

    def remote_failed(self, request_id: str, error: str) -> Request | None:
        if request_id not in self.receiving:
            return None
        req = self.finish(request_id, RequestStatus.FINISHED_ERROR)
        req.stop_reason = error
        return req

    def load_ended(self, request_id: str) -> None:
        """The request's read can no longer write its blocks; an aborted request's blocks are freed now."""
        self.loading.discard(request_id)
        if request_id in self.orphaned:
            self.orphaned.discard(request_id)
            self.kv.free(request_id)

    def _first_ready(self) -> Request | None:
        """The first waiting request whose grammar (if any) has compiled; the others keep their place."""
        return next((r for r in self.waiting if r.grammar is None or (r.grammar.ready() and r.grammar.error is None)),
                    None)

    def _cached_prefix(self, req: Request) -> tuple[list[int], int, int | None]:
        """(cached blocks, first position to compute, snapshot row to restore) for a request about to be
        admitted. A hit is a whole-block prefix that leaves at least one token to compute. The bounded
        state the blocks do not hold comes from a snapshot taken at the hit boundary if one is kept, or is
        rebuilt by recomputing `replay_tokens` before it."""
        if not self._caches(req):
            return [], 0, None
        req.block_hashes = chain_hashes(req.token_ids(0, req.num_tokens), self.kv.block_size, req.cache_salt,
                                        req.block_hashes, req.image_keys)
        prefix = self.kv.cached_prefix(req.block_hashes, req.num_tokens - 1)
        hit = len(prefix) * self.kv.block_size
        if not hit:
            return prefix, 0, None
        restore = self.kv.snapshot_for(req.block_hashes[len(prefix) - 1]) if self.replay_tokens else None
        return prefix, hit if restore is not None else max(hit - self.replay_tokens, 0), restore

    def _caches(self, req: Request) -> bool:
        return self.kv.enable_prefix_caching and req.params.prompt_logprobs is None

    def _resume_from(self, req: Request, prefix: list[int], start: int, restore: int | None,
                     out: SchedulerOutput) -> None:
        if not self._caches(req):
            return
        hit = len(prefix) * self.kv.block_size
        self.kv.record_lookup(req.num_prompt_tokens, min(hit, req.num_prompt_tokens))
        req.num_computed_tokens, req.resume_point = start, hit
        if restore is not None:
            out.restores.append((restore, self.kv.slots[req.request_id]))
            self.num_snapshot_restores += 1

    def _align(self, start: int, n: int) -> int:
        """With snapshots, a chunk that crosses a block boundary ends at its last one, so the bounded state
        there can be kept (it is only recoverable at the end of a step)."""
        if not self.kv.num_snapshot_slots or not self.config.enable_chunked_prefill:
            return n  # without chunked prefill a prompt is computed whole: snapshots come from decode steps
        boundary = (start + n) // self.kv.block_size * self.kv.block_size
        return boundary - start if boundary > start else n

    def _schedule_snapshots(self, out: SchedulerOutput) -> None:
        """Keep the bounded state of requests whose step ends on a block boundary with exact state."""
        if not (self.kv.num_snapshot_slots and self.kv.enable_prefix_caching):
            return
        bs = self.kv.block_size
        for s in out.scheduled:
            end, req = s.start + s.num_new_tokens, s.request
            if s.num_drafts or end % bs or end < req.resume_point or not self._caches(req) or s.placeholder:
                continue  # not on a boundary, still replaying (state inexact until the hit point), drafts not
                # verified yet, or async with the block's last token not known yet (its hash cannot be formed)
            req.block_hashes = chain_hashes(req.token_ids(0, end), bs, req.cache_salt, req.block_hashes,
                                            req.image_keys)
            row = self.kv.claim_snapshot(req.block_hashes[end // bs - 1])
            if row is not None:
                out.snapshots.append((s.state_slot, row))

    def _schedule_forks(self, out: SchedulerOutput) -> None:
        """Siblings of a request finishing its prompt this step share its cache instead of prefilling."""
        for s in list(out.scheduled):
            parent = s.request
            siblings = self.pending_forks.get(parent.request_id)
            if not siblings or not s.samples or parent.output_token_ids:
                continue
            for child in list(siblings):
                if len(self.running) >= self.config.max_num_seqs:
                    break
                copy = self.kv.fork(parent.request_id, child.request_id, parent.num_tokens)
                if copy is None:
                    break
                siblings.remove(child)
                child.status = RequestStatus.RUNNING
                child.num_computed_tokens = parent.num_tokens
                self.running.append(child)
                out.forks.append(copy)
                out.fork_children.append(child)
            self._release_siblings(parent.request_id)

    def _release_siblings(self, parent_id: str) -> None:
        """Siblings that could not fork prefill on their own."""
        for child in self.pending_forks.pop(parent_id, []):
            child.fork_of = None
            self._enqueue(child)

    def _scheduled(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledRequest:
        return ScheduledRequest(req, n, self.kv.blocks[req.request_id], self.kv.slots[req.request_id],
                                draft_token_ids=list(drafts or []))

    # --- results -----------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests; returns touched requests."""
        touched = []
        for s in out.scheduled:
            req = s.request
            before = _known_computed(req)
            accepted = result.accepted_drafts.get(req.request_id, [])
            if self.config.async_scheduling:  # never with drafts (speculation runs synchronous steps)
                req.num_pending -= s.samples
            else:
                rejected = s.draft_token_ids[len(accepted):]
                self.spec_stats.observe(s.num_drafts, len(accepted))
                req.num_computed_tokens += s.num_new_tokens - len(rejected)
                if rejected:
                    self._rolled_back(req, rejected)
            if req.is_finished:
                continue  # finished (or aborted) while this step was in flight: its token is discarded
            sampled = result.sampled.get(req.request_id)
            self._append(req, [] if sampled is None else [*accepted, sampled], before)
            req.spec_token_ids = result.drafts.get(req.request_id, [])
            req.spec_confidence = result.draft_confidence.get(req.request_id)
            touched.append(req)
        for child in out.fork_children:
            child.num_pending -= self.config.async_scheduling
            if not child.is_finished:
                self._append(child, [result.sampled[child.request_id]], _known_computed(child))
                touched.append(child)
        return touched

    def _rolled_back(self, req: Request, rejected: list[int]) -> None:
        """Rejected drafts: their positions are no longer computed; blocks past what the request can use
        next step go back to the pool. Listeners (grammar matchers) see the rejected tokens here."""
        self.kv.trim(req.request_id, req.num_computed_tokens + 1 + self.lookahead)
        for listener in self.rejection_listeners:
            listener(req, rejected)

    def _cache_computed_blocks(self, req: Request) -> None:
        """Blocks whose every position is computed and known become findable (they include generated tokens)."""
        full = _known_computed(req) // self.kv.block_size
        if not self.kv.enable_prefix_caching or full <= 0 or req.status != RequestStatus.RUNNING:
            return
        if len(req.block_hashes) < full:
            req.block_hashes = chain_hashes(req.token_ids(0, full * self.kv.block_size), self.kv.block_size,
                                            req.cache_salt, req.block_hashes, req.image_keys)
        self.kv.cache_full_blocks(req.request_id, req.block_hashes, full * self.kv.block_size)

    def _append(self, req: Request, tokens: list[int], known_before: int) -> None:
        """Append sampled tokens (accepted drafts, then the sampled one) up to the first that stops the request;
        blocks that became full and known are cached before a finish frees them."""
        status = None
        for token in tokens:
            req.output_token_ids.append(token)
            status = stop_status(req, token, self.max_model_len)
            if req.grammar is not None:
                status = grammar_status(req, token, status)
            if status is not None:
                break
        if known_before // self.kv.block_size < _known_computed(req) // self.kv.block_size:
            self._cache_computed_blocks(req)
        if status is not None:
            self.finish(req.request_id, status)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and return its resources."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        for siblings in self.pending_forks.values():
            if req in siblings:
                siblings.remove(req)
        if req.request_id in self.pending_forks:
            self._release_siblings(req.request_id)
        self.receiving.pop(request_id, None)
        req.status = status
        if request_id in self.loading:
            self.orphaned.add(request_id)  # its read may still write the blocks: load_ended frees them
        elif req.sends_cache and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.sent.append(req)  # its cache stays for the decode engine
        else:
            self.kv.free(req.request_id)
        return req


def _confidence(req: Request, empirical: list[float]) -> list[float]:
    """Predicted acceptance of each of req's drafts: the proposer's, else the measured rate by position."""
    if req.spec_confidence:
        return req.spec_confidence[:len(req.spec_token_ids)]
    return [empirical[i] if i < len(empirical) else 0.5 for i in range(len(req.spec_token_ids))]


def grammar_status(req: Request, token: int, status: RequestStatus | None) -> RequestStatus | None:
    """Advance the request's matcher by `token`: a finished grammar stops the request; a token the grammar
    rejects (it was sampled unmasked, a bug) fails it rather than emit invalid output."""
    if not req.grammar.accept(token):
        req.stop_reason = f"token {token} violates the {req.grammar.spec.kind} constraint"
        return RequestStatus.FINISHED_ERROR
    if status is None and req.grammar.terminated:
        req.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    return status


def whole_images(spans: tuple[tuple[int, int, str], ...], start: int, n: int, limit: int) -> int:
    """The chunk [start, start + n) adjusted so it never ends inside an image span (the span's embeddings go in
    whole): an end inside a span moves back to the span's start, or -- when the chunk starts inside or at that
    span -- forward to its end if that stays within `limit` tokens, else 0 (wait for a larger budget)."""
    end = start + n
    for a, b, _ in spans:
        if a < end < b:
            if a > start:
                return a - start
            return b - start if b - start <= limit else 0
    return n


def _known_computed(req: Request) -> int:
    """Positions whose KV is computed (or queued ahead of any reader) and whose token is known."""
    return min(req.num_computed_tokens, req.num_tokens)


def _scheduled_len(req: Request) -> int:
    """Tokens the request has once its pending (async, in flight) tokens arrive."""
    return req.num_tokens + req.num_pending


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Token-level stop rules (stop strings are the detokenizer's): EOS, stop ids, length."""
    params, n_out = req.params, len(req.output_token_ids)
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_output_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
