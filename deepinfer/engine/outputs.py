"""The contract between the scheduler (what to compute) and the model runner (tensors)."""

from __future__ import annotations

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
    # Draft tokens verified this step: the last len(draft_token_ids) of the num_new_tokens positions.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.start < 0:
            self.start = self.request.num_computed_tokens
        self.write_from = max(self.start, self.request.resume_point)
        self.samples = self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    forks: list[ForkCopy] = field(default_factory=list)
    fork_children: list[Request] = field(default_factory=list)  # parallel to forks
    preempted: list[str] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot row, state slot) before the step
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (state slot, snapshot row) after the step
    propose_drafts: bool = True  # False: no drafting this step (adaptive policy measured plain decoding faster)

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
