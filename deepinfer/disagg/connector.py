"""The engine-side mechanisms of disaggregation, next to the cache tensors (single-process engines).

Prefill role (PrefillConnector): a request sent with `do_remote_decode` computes its prompt and first token;
the scheduler then hands its blocks and state slot to a held key instead of freeing them, and this connector
records what the decode side needs. The hold ends when the decode side says it is done (after its read, or
after giving up), or when the lease runs out; a decode engine that asks for the record extends the lease to
the transfer timeout, so a read in progress is never freed under it.

Decode role (DecodeConnector): the scheduler reserves blocks and a state slot for a request that carries a
prefill engine's `kv_transfer_params` and emits a KVLoad; this connector handshakes with that engine (once per
peer; the layouts must match), fetches the record, reads the planned ranges on a worker thread, tells the
prefill engine to release, and reports the outcome. A read that outlives the transfer timeout fails its
request at once; its blocks are freed only when the read has ended (`ended`), since it may still write them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from deepinfer.disagg import control
from deepinfer.disagg.layout import check_compatible, describe, model_digest
from deepinfer.disagg.plan import Side, plan_reads, total_bytes
from deepinfer.disagg.transport import make_transport
from deepinfer.engine.kv_cache import prompt_digest
from deepinfer.engine.outputs import KVLoad

logger = logging.getLogger("deepinfer")
HELD_PREFIX = "pd:"  # kv-manager keys of held (sending) requests
RELEASE_TIMEOUT_S = 1.0  # a release the prefill engine does not answer is left to its lease


@dataclass
class TransferStats:
    sent: int = 0  # prefill: requests handed to a decode engine
    released: int = 0  # prefill: holds ended by the decode side
    leases_expired: int = 0  # prefill: holds ended by their lease
    received: int = 0  # decode: transfers completed
    failed: int = 0  # decode: transfers that failed or timed out
    bytes: int = 0  # decode: bytes read
    seconds: float = 0.0  # decode: time from start to completion, summed
    per_request: list[tuple[int, float]] = field(default_factory=list)  # decode: (bytes, seconds), last 1024


def _layout(core) -> dict:
    runner = core.runner
    return describe(runner.specs, core.layout.num_blocks, core.layout.state_rows, core.layout.block_size,
                    model_digest(core.model_config))


class _Connector:
    def __init__(self, core):
        args = core.args
        self.kv, self.stats = core.kv, TransferStats()
        self.host, self.timeout_s = args.disaggregation_bootstrap_host, args.disaggregation_transfer_timeout_s
        self.transport = make_transport(args.disaggregation_transfer_backend, self.host)
        self.transport.register(core.runner.cache)
        self.layout = _layout(core)

    def close(self) -> None:
        self.transport.close()


@dataclass
class _Held:
    key: str
    record: dict
    deadline: float


class PrefillConnector(_Connector):
    role = "prefill"

    def __init__(self, core):
        super().__init__(core)
        self.lease_s = core.args.disaggregation_lease_s
        self.engine_id = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # transfer id -> hold; engine thread and bootstrap thread
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.server = control.BootstrapServer(self.host, core.args.disaggregation_bootstrap_port, self._handle)
        logger.info("disaggregation: prefill engine %s, bootstrap at %s, %s transport", self.engine_id,
                    self.server.address, self.transport.name)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def sent(self, req, result) -> dict:
        """Engine thread, right after the request's prefill step: hold its cache; the kv_transfer_params the
        decode engine is given."""
        transfer_id = uuid.uuid4().hex
        key = HELD_PREFIX + transfer_id
        blocks, slot = self.kv.hold(req.request_id, key)
        record = {"num_tokens": req.num_prompt_tokens, "prompt_digest": prompt_digest(req.prompt_token_ids),
                  "blocks": blocks, "slot": slot, "first_token": req.output_token_ids[0],
                  "logprobs": result.logprobs.get(req.request_id), "drafts": result.drafts.get(req.request_id, []),
                  "generator": bytes(req.generator.get_state().numpy()) if req.generator is not None else None}
        with self._lock:
            self._held[transfer_id] = _Held(key, record, time.monotonic() + self.lease_s)
        self.stats.sent += 1
        return {"remote_bootstrap": self.server.address, "transfer_id": transfer_id, "engine_id": self.engine_id}

    def service(self) -> None:
        """Engine thread: free holds the decode side released or whose lease ran out."""
        now, ended = time.monotonic(), []
        while True:
            try:
                ended.append((self._released.get_nowait(), "released"))
            except queue.Empty:
                break
        with self._lock:
            ended += [(tid, "expired") for tid, h in self._held.items() if h.deadline <= now]
            holds = [(self._held.pop(tid, None), why) for tid, why in ended]
        for hold, why in holds:
            if hold is not None:
                self.kv.free(hold.key)
                self._count(why, hold.key)

    def _count(self, why: str, key: str) -> None:
        if why == "released":
            self.stats.released += 1
        else:
            self.stats.leases_expired += 1
            logger.warning("disaggregation: transfer %s was not collected within its lease; freed", key)

    def _handle(self, msg: dict) -> dict:
        """Bootstrap thread."""
        op = msg.get("op")
        if op == "handshake":
            return {"layout": self.layout, "endpoint": self.transport.endpoint(), "engine_id": self.engine_id}
        with self._lock:
            hold = self._held.get(msg.get("transfer_id", ""))
            if hold is not None and op == "describe":  # the read starts: keep the blocks for its whole bound
                bound = max(self.timeout_s, float(msg.get("timeout_s", 0)))
                hold.deadline = max(hold.deadline, time.monotonic() + bound + 1)
        if op == "describe":
            if hold is None:
                return {"error": "unknown transfer id: it expired, was released, or was never on this engine"}
            return hold.record
        if op == "done":
            self._released.put(msg.get("transfer_id", ""))
            return {"ok": True}
        return {"error": f"unknown operation {op!r}"}

    def close(self) -> None:
        self.server.close()
        super().close()


@dataclass
class _Read:
    """One transfer on the worker pool. Its time bound runs from when a worker picks it up (`begun`); a read
    still queued after twice the bound is cancelled."""

    future: Future | None = None
    submitted: float = field(default_factory=time.monotonic)
    begun: float | None = None
    finished: float | None = None
    reported: bool = False  # its outcome was reported (it may still be running: "ended" comes later)


@dataclass(frozen=True)
class LoadEvent:
    request_id: str
    kind: str  # "arrived" (record set) | "failed" (error set) | "ended" (the read can no longer write)
    record: dict | None = None
    error: str | None = None


class DecodeConnector(_Connector):
    role = "decode"

    def __init__(self, core):
        super().__init__(core)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="deepinfer-kv-read")
        self._peers: dict[str, tuple[dict, dict]] = {}  # bootstrap -> (layout, endpoint), checked
        self._active: dict[str, _Read] = {}
        self._done = threading.Event()
        logger.info("disaggregation: decode engine, %s transport", self.transport.name)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def start(self, load: KVLoad) -> None:
        read = self._active[load.request_id] = _Read()
        read.future = self._pool.submit(self._receive, load, read)
        read.future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout_s: float) -> None:
        self._done.wait(timeout_s)
        self._done.clear()

    def poll(self) -> list[LoadEvent]:
        events = []
        for rid, read in list(self._active.items()):
            if read.future.done():
                if not read.reported:
                    events.append(self._outcome(rid, read))
                events.append(LoadEvent(rid, "ended"))
                del self._active[rid]
            elif not read.reported and (error := self._overdue(read)) is not None:
                read.reported = True
                self.stats.failed += 1
                events.append(LoadEvent(rid, "failed", error=error))
        return events

    def _overdue(self, read: _Read) -> str | None:
        now = time.monotonic()
        if read.begun is not None and now - read.begun > self.timeout_s:
            return f"the KV transfer did not finish within {self.timeout_s} s (prefill engine hung or unreachable)"
        if read.begun is None and now - read.submitted > 2 * self.timeout_s and read.future.cancel():
            return f"the KV transfer waited {2 * self.timeout_s} s for a transfer worker (all busy)"
        return None

    def _outcome(self, rid: str, read: _Read) -> LoadEvent:
        error = "cancelled" if read.future.cancelled() else read.future.exception()
        if error is None and read.finished - read.begun > self.timeout_s:
            error = "it finished after its time bound, when the prefill engine may have freed the blocks"
        if error is not None:
            self.stats.failed += 1
            return LoadEvent(rid, "failed", error=f"KV transfer failed: {error}")
        record, nbytes = read.future.result()
        self.stats.received += 1
        self.stats.bytes += nbytes
        self.stats.seconds += read.finished - read.submitted
        self.stats.per_request = [*self.stats.per_request[-1023:], (nbytes, read.finished - read.submitted)]
        return LoadEvent(rid, "arrived", record=record)

    def _receive(self, load: KVLoad, read: _Read) -> tuple[dict, int]:
        """Worker thread: handshake, record, read, release. The prefill side is told to release even when the
        read fails, so its blocks do not wait for the lease."""
        read.begun = time.monotonic()
        address, transfer_id = load.params["remote_bootstrap"], load.params["transfer_id"]
        try:
            layout, endpoint = self._peer(address, load.params.get("engine_id"))
            record = control.call(address, {"op": "describe", "transfer_id": transfer_id,
                                            "timeout_s": self.timeout_s}, self.timeout_s)
            _check_record(record, load)
            spans = plan_reads(self.layout, layout, load.num_tokens, Side(load.blocks, load.slot),
                               Side(record["blocks"], record["slot"]), load.skip_blocks)
            self.transport.read(endpoint, spans, self.timeout_s)
        finally:
            read.finished = time.monotonic()
            _release(address, transfer_id, min(self.timeout_s, RELEASE_TIMEOUT_S))
        return record, total_bytes(spans)

    def _peer(self, address: str, engine_id: str | None) -> tuple[dict, dict]:
        """The prefill engine's (layout, endpoint), checked once per engine instance (a restarted engine on the
        same address has a new id, endpoint and maybe layout)."""
        key = (address, engine_id)
        if key not in self._peers:
            answer = control.call(address, {"op": "handshake"}, self.timeout_s)
            if engine_id is not None and answer.get("engine_id") != engine_id:
                raise ValueError(f"the prefill engine at {address} restarted since it computed this prompt "
                                 f"(engine {answer.get('engine_id')}, not {engine_id})")
            check_compatible(self.layout, answer["layout"])
            if answer["endpoint"]["backend"] != self.transport.name:
                raise ValueError(f"the prefill engine at {address} uses the {answer['endpoint']['backend']} "
                                 f"transport, this engine {self.transport.name}")
            self._peers[key] = (answer["layout"], answer["endpoint"])
        return self._peers[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def _check_record(record: dict, load: KVLoad) -> None:
    if record["num_tokens"] != load.num_tokens or record["prompt_digest"] != load.prompt_digest:
        raise ValueError("the prefill engine computed a different prompt than this request's "
                         f"({record['num_tokens']} tokens there, {load.num_tokens} here)")


def _release(address: str, transfer_id: str, timeout_s: float) -> None:
    try:
        control.call(address, {"op": "done", "transfer_id": transfer_id}, timeout_s)
    except control.ControlError as e:  # its lease frees the blocks
        logger.warning("disaggregation: could not release transfer %s on %s: %s", transfer_id, address, e)


def restore_generator(req, record: dict) -> None:
    """Seeded sampling continues from the prefill engine's generator (it drew the first token)."""
    if req.generator is not None and record.get("generator"):
        req.generator.set_state(torch.frombuffer(bytearray(record["generator"]), dtype=torch.uint8))


def build_connector(core):
    mode = core.args.disaggregation_mode
    if mode == "none":
        return None
    return PrefillConnector(core) if mode == "prefill" else DecodeConnector(core)
