"""The contract between the scheduler (what to compute) and the model runner (tensors)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.kv_cache import ForkCopy
from deepinfer.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    state_slot: int
    start: int = -1  # tokens already in the cache when scheduled
    samples: bool = False  # this step brings the cache up to all of the request's tokens
    write_from: int = 0  # paged state of positions below this is a shared prefix: read, never written
    # Async scheduling: the last input token is the one this request samples in the step before (not
    # known yet when scheduled); the runner fills it in. num_outputs: outputs known when scheduled.
    placeholder: bool = False
    num_outputs: int = 0
    # Draft tokens verified this step: the last len(draft_token_ids) of the num_new_tokens positions.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        req = self.request
        if self.start < 0:
            self.start = req.num_computed_tokens
        self.write_from = max(self.start, req.resume_point)
        end = self.start + self.num_new_tokens - len(self.draft_token_ids)  # drafts follow the real tokens
        self.samples = end == req.num_tokens + req.num_pending
        self.placeholder = end > req.num_tokens
        self.num_outputs = len(req.output_token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass(frozen=True)
class KVLoad:
    """Disaggregation, decode engine: read this request's prompt cache from its prefill engine into the blocks
    and state slot reserved for it (the first `skip_blocks` blocks are a local prefix-cache hit)."""

    request_id: str
    params: dict  # the request's kv_transfer_params (remote_bootstrap, transfer_id)
    num_tokens: int
    prompt_digest: str
    blocks: list[int]
    slot: int
    skip_blocks: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    forks: list[ForkCopy] = field(default_factory=list)
    fork_children: list[Request] = field(default_factory=list)  # parallel to forks
    preempted: list[str] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot row, state slot) before the step
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (state slot, snapshot row) after the step
    # Structured outputs: resolves to (request ids, int32 bitmask [K, ceil(V/32)]) of the sampling requests
    # whose next token is constrained; None when no row is constrained.
    grammar_bitmask: Future | None = None
    propose_drafts: bool = True  # False: no drafting this step (adaptive policy measured plain decoding faster)
    kv_loads: list[KVLoad] = field(default_factory=list)  # disaggregation: transfers to start (no compute)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Per request id: the sampled token, its logprob info, and prompt logprobs computed this step. With
    speculation, `accepted_drafts` are the verified drafts that precede `sampled` (the correction or bonus
    token), and `drafts` the proposals for the next step."""

    sampled: dict[str, int] = field(default_factory=dict)
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    draft_confidence: dict[str, list[float]] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)  # ids, lps, rank
    prompt_logprobs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
