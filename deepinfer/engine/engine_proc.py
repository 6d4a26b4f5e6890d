"""The engine process: an EngineCore behind two ZeroMQ sockets (PULL for input, PUSH for output).

The API process binds both sockets and spawns `run_engine`, which connects, reports `EngineReady`
(or `EngineFailure` and exits 1), then serves until a `Shutdown` message or its parent dies.
Detokenisation and stop strings are the API process's job; this process only moves token ids.

Invariants of the serving loop:
- every pending input message is applied before each step, so requests that arrive together are
  scheduled together; the loop only blocks (with a timeout) when nothing is unfinished;
- a request that fails validation gets a `RequestError` and changes nothing else;
- an exception in `step()` fails only the parent requests with a sample scheduled in that step;
  every other request keeps its cache and continues.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from deepinfer.config import EngineArgs
from deepinfer.distributed.dp_engine import build_engine
from deepinfer.engine.core import EngineCore
from deepinfer.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineStats,
    EplbMetrics,
    LogprobEntry,
    RankMetrics,
    ReplicaMetrics,
    RequestError,
    ResetPrefixCache,
    Shutdown,
    decode_input,
    encode,
)
from deepinfer.engine.outputs import SchedulerOutput
from deepinfer.llm import resolve_model
from deepinfer.logger import setup_logging
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.threads import set_engine_threads

logger = logging.getLogger("deepinfer")

IDLE_POLL_MS = 200  # how long an idle engine waits for input before re-checking its parent
STATS_INTERVAL_S = 0.25
LINGER_MS = 1000  # how long a closing output socket may spend delivering its last messages


@dataclass
class _Sample:
    parent_id: str
    request: Request
    num_sent: int = 0  # output tokens already sent


@dataclass
class _Group:
    """One parent request: its n samples and how many prompt-logprob rows were sent."""

    request_id: str
    sample_ids: list[str]
    num_prompt_tokens: int
    prompt_rows_sent: int = 0  # row p scores prompt token p + 1; rows [0, prompt_rows_sent) were sent


class EngineLoop:
    """Engine-side bookkeeping with no I/O: adds, aborts, step -> EngineOutputs, stats.

    `samples` holds exactly the samples whose final output has not been produced yet;
    `groups` holds exactly the parents with at least one such sample.
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, _Sample] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # --- input -----------------------------------------------------------------------------------
    def add(self, msg: AddRequest) -> RequestError | None:
        """Queue a request; a rejection leaves the engine exactly as it was."""
        try:
            if msg.request_id in self.groups:
                raise ValueError(f"request id {msg.request_id!r} is already in use")
            params = SamplingParams(**msg.params)
            images = _images(msg.images)
            requests = self.core.add_request(msg.request_id, list(msg.prompt_token_ids), params, msg.priority,
                                             cache_salt=msg.cache_salt, kv_transfer=msg.kv_transfer,
                                             **({"images": images} if images else {}))
        except ValueError as e:
            return RequestError(msg.request_id, str(e), 400)
        except Exception as e:  # a bug, not bad input: report it and keep serving
            logger.exception("adding request %s failed", msg.request_id)
            return RequestError(msg.request_id, f"{type(e).__name__}: {e}", 500)
        self._track(msg.request_id, requests)
        return None

    def _track(self, parent_id: str, requests: list[Request]) -> None:
        self.groups[parent_id] = _Group(parent_id, [r.request_id for r in requests], requests[0].num_prompt_tokens)
        for req in requests:
            self.samples[req.request_id] = _Sample(parent_id, req)
        self.prompt_tokens_total += requests[0].num_prompt_tokens

    def abort(self, parent_id: str, sample_index: int | None = None) -> None:
        """Abort every sample of a parent, or one of them; silent (the client already ended that stream)."""
        group = self.groups.get(parent_id)
        if group is None:
            return
        chosen = group.sample_ids if sample_index is None else group.sample_ids[sample_index:sample_index + 1]
        for sample_id in chosen:
            if sample_id in self.samples:
                self.core.abort(sample_id)
                self._forget(sample_id)

    # --- stepping --------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        before = self.core.last_scheduled
        try:
            touched = self.core.step()
        except Exception as e:
            if getattr(e, "fatal", False):  # the engine cannot continue (a rank died): exit, the server reports it
                raise
            return self._fail_step(before, e)
        return [self._output(req) for req in touched if req.request_id in self.samples]

    def _output(self, req: Request) -> EngineOutput:
        sample = self.samples[req.request_id]
        group = self.groups[sample.parent_id]
        new = req.output_token_ids[sample.num_sent:]
        sample.num_sent += len(new)
        self.generation_tokens_total += len(new)
        out = EngineOutput(group.request_id, req.sample_index, new, self._logprobs(req, new),
                           self._prompt_logprobs(group, req), num_prompt_tokens=group.num_prompt_tokens)
        if req.is_finished:
            out.finish_reason, out.stop_reason = req.status.value, req.stop_reason
            out.kv_transfer_params = req.kv_transfer_params
            if req.receives_cache and req.status == RequestStatus.FINISHED_ERROR:
                out.error = str(req.stop_reason)  # its cache never arrived: the request fails (500)
            self._forget(req.request_id)
        return out

    def _logprobs(self, req: Request, new: list[int]) -> list[LogprobEntry] | None:
        if req.params.logprobs is None:
            return None
        entry = self.core.last_result.logprobs.get(req.request_id)
        # A request samples at most one token per step, so this step's entry belongs to new[-1].
        return [entry] if new and entry is not None else []

    def _prompt_logprobs(self, group: _Group, req: Request) -> list[LogprobEntry] | None:
        chunk = self.core.last_result.prompt_logprobs.get(req.request_id)
        if chunk is None:
            return None
        ids, lps, ranks = (t.tolist() for t in chunk)
        # The chunk covers rows [stop - len, stop); a recompute after preemption (or a sibling that
        # prefilled alone) repeats rows already sent, which are skipped. The step's own extent, not the
        # request's computed count: with async scheduling that already includes the next step.
        end = next((s.start + s.num_new_tokens for s in self.core.last_scheduled.scheduled if s.request is req),
                   req.num_computed_tokens)
        stop = min(end, req.num_prompt_tokens - 1)
        skip = max(group.prompt_rows_sent - (stop - len(ids)), 0)
        group.prompt_rows_sent = max(group.prompt_rows_sent, stop)
        rows = list(zip(ids, lps, ranks))[skip:]
        return rows or None

    def _forget(self, sample_id: str) -> None:
        sample = self.samples.pop(sample_id)
        group = self.groups[sample.parent_id]
        if not any(s in self.samples for s in group.sample_ids):
            del self.groups[sample.parent_id]

    # --- failures --------------------------------------------------------------------------------
    def _fail_step(self, before: SchedulerOutput, error: Exception) -> list[EngineOutput]:
        """Fail the parents of every sample the failed step scheduled; the rest are untouched."""
        logger.exception("engine step failed; failing the requests it scheduled")
        scheduled = self.core.last_scheduled
        if scheduled is before:  # schedule() itself raised: blame whatever was running
            requests = [r for core in replicas(self.core) for r in core.scheduler.running]
        else:
            requests = [s.request for s in scheduled.scheduled] + list(scheduled.fork_children)
        parents = dict.fromkeys(self.samples[r.request_id].parent_id for r in requests
                                if r.request_id in self.samples)
        message = f"engine step failed: {type(error).__name__}: {error}"
        return [out for parent in parents for out in self._fail_group(parent, message)]

    def _fail_group(self, parent_id: str, message: str) -> list[EngineOutput]:
        group = self.groups.pop(parent_id)
        outputs = []
        for sample_id in group.sample_ids:
            sample = self.samples.pop(sample_id, None)
            if sample is None:  # this sample's final output was already produced
                continue
            self.core.abort(sample_id, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineOutput(parent_id, sample.request.sample_index, [], finish_reason="error",
                                        num_prompt_tokens=group.num_prompt_tokens, error=message))
        return outputs

    # --- stats -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Summed over DP replicas (one for most engines); kv usage is the busiest replica's."""
        cores = replicas(self.core)
        scheds, kvs = [c.scheduler for c in cores], [c.kv for c in cores]
        waiting = sum(len(s.waiting) + sum(len(f) for f in s.pending_forks.values()) for s in scheds)
        specs = [s.spec_stats for s in scheds]
        accepted = [sum(x) for x in itertools.zip_longest(*(s.accepted_per_pos for s in specs), fillvalue=0)]
        stats = EngineStats(sum(len(s.running) for s in scheds), waiting, max(kv.usage() for kv in kvs),
                           sum(kv.num_free_blocks for kv in kvs), sum(c.layout.num_blocks for c in cores),
                           self.prompt_tokens_total, self.generation_tokens_total,
                           sum(s.num_preemptions for s in scheds), time.time(),
                           sum(kv.prefix_queries for kv in kvs), sum(kv.prefix_hits for kv in kvs),
                           sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
                           sum(s.num_accepted_tokens for s in specs), accepted,
                           [_replica_metrics(d, c) for d, c in enumerate(cores)] if len(cores) > 1 else [],
                           *_rank_metrics(self.core))
        _add_transfer_stats(stats, [c.connector for c in cores if getattr(c, "connector", None) is not None])
        _add_image_stats(stats, [c.runner.encoder for c in cores if getattr(getattr(c, "runner", None), "encoder",
                                                                               None) is not None])
        return stats


def _add_image_stats(stats: EngineStats, encoders) -> None:
    for e in encoders:
        stats.images_encoded += e.images_encoded
        stats.image_encoder_seconds += e.encoder_seconds
        stats.image_cache_hits += e.cache_hits


def _add_transfer_stats(stats: EngineStats, connectors) -> None:
    for c in connectors:
        t = c.stats
        stats.kv_transfers_held += getattr(c, "num_held", 0)
        stats.kv_transfers_sent += t.sent
        stats.kv_transfers_released += t.released
        stats.kv_transfer_leases_expired += t.leases_expired
        stats.kv_transfers_received += t.received
        stats.kv_transfers_failed += t.failed
        stats.kv_transfer_bytes += t.bytes
        stats.kv_transfer_seconds += t.seconds


def _replica_metrics(d: int, core: EngineCore) -> ReplicaMetrics:
    sched = core.scheduler
    return ReplicaMetrics(d, len(sched.running), len(sched.waiting), core.kv.usage())


def _rank_metrics(core) -> tuple[list[RankMetrics], list[float], EplbMetrics | None, list[list[int]]]:
    """(per rank metrics, per MoE layer EP balancedness, EPLB counters, expert load), asked of the ranks between
    steps (one round trip)."""
    executor = core.executor
    if executor is None:
        return [], [], None, []
    stats = executor.rank_stats()
    ranks = [RankMetrics(s.rank, s.dp_rank, s.tp_rank, s.param_bytes, s.expert_param_bytes, s.peak_rss_bytes,
                         s.moe_payload_bytes, s.steps) for s in stats]
    load = executor.expert_load(stats)
    return ranks, executor.expert_balancedness(stats), _eplb_metrics(stats), [] if load is None else load.tolist()


def _eplb_metrics(stats) -> EplbMetrics | None:
    counters = [s.eplb for s in stats if s.eplb]
    if not counters:
        return None
    first = counters[0]
    return EplbMetrics(first["rebalances"], first["layers_moved"], first["experts_moved"],
                       max(c["move_seconds"] for c in counters), first["balancedness_before"],
                       first["balancedness_after"])


def replicas(core) -> list[EngineCore]:
    """The EngineCores behind `core`: its DP replicas, or itself."""
    return getattr(core, "replicas", [core])


def ready_message(core: EngineCore) -> EngineReady:
    cfg, layout = core.model_config, core.layout
    return EngineReady(cfg.model_type, cfg.vocab_size, core.max_model_len, list(cfg.eos_token_ids),
                       layout.block_size, layout.num_blocks, layout.bytes_per_token, layout.num_tokens,
                       core.args.max_num_seqs)


class _Server:
    """Moves messages between the sockets and an EngineLoop until shutdown or the parent's death."""

    def __init__(self, loop: EngineLoop, inp: zmq.Socket, out: zmq.Socket, parent_pid: int | None):
        self.loop, self.inp, self.out, self.parent_pid = loop, inp, out, parent_pid
        self.last_stats = 0.0
        self.pools = [c.kv.pool for c in replicas(loop.core)] if loop.core.args.kv_events else []
        for pool in self.pools:
            pool.record_events()
        self.dirty = True  # something changed since stats were last sent

    def run(self) -> None:
        while self._parent_alive():
            busy = self.loop.core.has_unfinished
            if not busy:  # disaggregation: leases run out and aborted reads end while idle too
                for core in replicas(self.loop.core):
                    core.service_transfers()
            if not self._apply(self._receive(0 if busy else IDLE_POLL_MS)):
                return
            self._send(self.loop.step() if self.loop.core.has_unfinished else [])

    def _parent_alive(self) -> bool:
        # A dead parent's children are re-parented, so getppid() stops matching.
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _receive(self, timeout_ms: int) -> list:
        messages = []
        if not self.inp.poll(timeout_ms):
            return messages
        while True:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode_input(data))
            except msgspec.DecodeError:
                logger.exception("dropping a malformed input message")

    def _apply(self, messages: list) -> bool:
        """Apply messages in order; False when told to shut down."""
        for msg in messages:
            self.dirty = True
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, ResetPrefixCache):
                self.loop.core.reset_prefix_cache()
            elif isinstance(msg, AbortRequest):
                for request_id in msg.request_ids:
                    self.loop.abort(request_id, msg.sample_index)
            elif (error := self.loop.add(msg)) is not None:
                self.out.send(encode(error))
        return True

    def _send(self, outputs: list[EngineOutput]) -> None:
        now = time.monotonic()
        self.dirty = self.dirty or bool(outputs)
        idle = not self.loop.core.has_unfinished
        stats_due = now - self.last_stats >= STATS_INTERVAL_S or (idle and self.dirty)
        events = [e for pool in self.pools for e in pool.drain_events()]
        if not outputs and not stats_due and not events:
            return
        stats = self.loop.stats() if stats_due else None
        if stats_due:
            self.last_stats, self.dirty = now, False
        self.out.send(encode(EngineOutputs(outputs, stats, events)), copy=False)


def build_core(model_path: str | None, engine_kwargs: dict) -> EngineCore:
    path, _ = resolve_model(model_path)
    args = EngineArgs.from_kwargs(**engine_kwargs)
    if args.parallel.world_size == 1 and not args.deterministic:  # ranks set their own; see worker/threads.py
        set_engine_threads(torch.device(args.device), args.cpu_threads, served=True)
    return build_engine(path, args)


def run_engine(model_path: str | None, engine_kwargs: dict, input_addr: str, output_addr: str,
               parent_pid: int | None = None, log_level: int | None = None) -> None:
    """Process entry point (started with the "spawn" context). Exits 1 after an EngineFailure."""
    # Ctrl-C and SIGTERM to the process group are the parent's to handle: it drains, then sends Shutdown
    # (and the parent-death check still ends us if the parent is killed outright).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _setup_logging(log_level)
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(input_addr)
    out.connect(output_addr)
    try:
        ok = _serve(model_path, engine_kwargs, inp, out, parent_pid)
    finally:
        inp.close(linger=0)
        out.close(linger=LINGER_MS)
        ctx.term()
    if not ok:
        sys.exit(1)


def _serve(model_path, engine_kwargs, inp, out, parent_pid) -> bool:
    try:
        loop = EngineLoop(build_core(model_path, engine_kwargs))
        out.send(encode(ready_message(loop.core)))
        warm = getattr(loop.core, "warm_structured_outputs", None)  # served engines: no stall at the first use
        if warm is not None:
            warm()
        _Server(loop, inp, out, parent_pid).run()
        loop.core.shutdown()
        return True
    except Exception as e:
        logger.exception("the engine failed")
        _send_failure(out, f"{type(e).__name__}: {e}")
        return False


def _send_failure(out: zmq.Socket, message: str) -> None:
    try:
        out.send(encode(EngineFailure(message)), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # nobody is listening; the exit code tells the parent


def _setup_logging(level: int | None) -> None:
    """Mirror the parent's deepinfer log level (a spawned child starts with no logging set up)."""
    if level is None:
        return
    setup_logging(level, "deepinfer[engine]: %(message)s")


def _images(wire: list[dict] | None) -> list | None:
    """ImageSpans from their wire form (ImageError, a ValueError, for a malformed one)."""
    if not wire:
        return None
    from deepinfer.multimodal.inputs import ImageSpan

    return [ImageSpan.from_wire(d) for d in wire]
