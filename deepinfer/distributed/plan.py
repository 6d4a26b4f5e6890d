"""A step's SchedulerOutput as it travels to the ranks of one DP replica, and the requests mirrored there.

The scheduler (one per DP replica, in the driver) owns the requests; every rank of the replica keeps a mirror of
each request it has been sent (prompt, sampling params, the output tokens so far, its own generator), so the
model runner runs unchanged on the rank. A plan carries only what changed since the replica last saw a request:
new requests whole, then per scheduled request the output tokens appended since (outputs only grow: a resync
point `known` truncates first, so a rewound output would also be exact). Finished requests are dropped.

Invariants:
- ``PlanEncoder`` (driver) and ``MirrorBook`` (rank) see the same sequence of plans, in order; after decoding
  plan k, every mirror's prompt and outputs equal the driver request's at the time plan k was encoded.
- ScheduledRequest fields are copied as the scheduler computed them, never recomputed on the rank.
- Plans hold only picklable plain data (ints, lists, SamplingParams, CPU tensors).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.kv_cache import ForkCopy
from deepinfer.engine.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

_SCHEDULED_FIELDS = ("num_new_tokens", "block_ids", "state_slot", "start", "samples", "write_from", "placeholder",
                     "num_outputs", "draft_token_ids")


@dataclass(frozen=True)
class NewRequest:
    """What a rank needs to build its mirror of a request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int
    eos_token_ids: tuple[int, ...]
    sample_index: int

    @classmethod
    def of(cls, req: Request) -> NewRequest:
        return cls(req.request_id, list(req.prompt_token_ids), req.params, req.max_output_tokens,
                   tuple(req.eos_token_ids), req.sample_index)

    def build(self) -> Request:
        return Request(self.request_id, list(self.prompt_token_ids), self.params, self.max_output_tokens,
                       eos_token_ids=self.eos_token_ids, sample_index=self.sample_index)


@dataclass(frozen=True)
class ScheduledItem:
    """One ScheduledRequest: its fields, plus the request's outputs from index `known` on (the rank truncates
    its mirror to `known` outputs, then appends `new_outputs`)."""

    request_id: str
    known: int
    new_outputs: list[int]
    fields: tuple


@dataclass
class ReplicaPlan:
    """A step of one DP replica. Empty `scheduled`: the replica is idle this step (it only joins collectives)."""

    new: list[NewRequest] = field(default_factory=list)
    scheduled: list[ScheduledItem] = field(default_factory=list)
    forks: list[ForkCopy] = field(default_factory=list)
    fork_children: list[NewRequest] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    grammar: tuple[list[str], torch.Tensor] | None = None  # the resolved bitmask (ids, int32 [K, words])
    grammar_pending: bool = False  # the bitmask follows as a ("mask", step, value) message (async scheduling)
    propose_drafts: bool = True
    dropped: list[str] = field(default_factory=list)  # finished since the last plan: forget their mirrors

    @property
    def is_idle(self) -> bool:
        return not self.scheduled


class PlanEncoder:
    """Driver side, one per DP replica: SchedulerOutput -> ReplicaPlan, remembering what the ranks hold."""

    def __init__(self):
        self.synced: dict[str, int] = {}  # request id -> outputs the ranks' mirror holds

    def encode(self, out: SchedulerOutput, live: set[str], defer_grammar: bool = False) -> ReplicaPlan:
        """`live`: ids the scheduler still tracks (mirrors of the others are dropped). defer_grammar: a bitmask
        not resolved yet is not waited for; the plan says it follows."""
        plan = ReplicaPlan(dropped=self._drop(live), forks=list(out.forks), restores=list(out.restores),
                           snapshots=list(out.snapshots), propose_drafts=out.propose_drafts)
        for s in out.scheduled:
            plan.scheduled.append(self._item(s, plan))
        for child in out.fork_children:
            plan.fork_children.append(NewRequest.of(child))
            self.synced[child.request_id] = 0
        mask = out.grammar_bitmask
        if mask is not None and defer_grammar and not mask.done():
            plan.grammar_pending = True
        elif mask is not None:  # the rank samples; the mask must be final before it is sent
            plan.grammar = mask.result()
        return plan

    def _drop(self, live: set[str]) -> list[str]:
        gone = [rid for rid in self.synced if rid not in live]
        for rid in gone:
            del self.synced[rid]
        return gone

    def _item(self, s: ScheduledRequest, plan: ReplicaPlan) -> ScheduledItem:
        req = s.request
        if req.request_id not in self.synced:
            plan.new.append(NewRequest.of(req))
            self.synced[req.request_id] = 0
        known = min(self.synced[req.request_id], len(req.output_token_ids))
        self.synced[req.request_id] = len(req.output_token_ids)
        fields = tuple(getattr(s, name) for name in _SCHEDULED_FIELDS)
        return ScheduledItem(req.request_id, known, req.output_token_ids[known:], fields)


class MirrorBook:
    """Rank side, one per rank: the mirrors of its replica's requests, and ReplicaPlan -> SchedulerOutput."""

    def __init__(self):
        self.requests: dict[str, Request] = {}

    def decode(self, plan: ReplicaPlan, pending_mask: Future | None = None) -> SchedulerOutput:
        """pending_mask: the bitmask's stand-in when the plan says it follows."""
        for rid in plan.dropped:
            self.requests.pop(rid, None)
        for new in plan.new + plan.fork_children:
            self.requests[new.request_id] = new.build()
        scheduled = [self._scheduled(item) for item in plan.scheduled]
        children = [self.requests[c.request_id] for c in plan.fork_children]
        grammar = _resolved(plan.grammar) if plan.grammar is not None else None
        if plan.grammar_pending:
            grammar = pending_mask
        return SchedulerOutput(scheduled, list(plan.forks), children, restores=list(plan.restores),
                               snapshots=list(plan.snapshots), grammar_bitmask=grammar,
                               propose_drafts=plan.propose_drafts)

    def _scheduled(self, item: ScheduledItem) -> ScheduledRequest:
        req = self.requests[item.request_id]
        del req.output_token_ids[item.known:]
        req.output_token_ids.extend(item.new_outputs)
        s = ScheduledRequest.__new__(ScheduledRequest)  # fields as the scheduler computed them: no __post_init__
        s.request = req
        for name, value in zip(_SCHEDULED_FIELDS, item.fields):
            setattr(s, name, value)
        return s


def _resolved(value) -> Future:
    """The runner reads the bitmask through a Future."""
    future = Future()
    future.set_result(value)
    return future
