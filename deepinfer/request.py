"""A request as the engine sees it: tokens, how many are in the cache, and output bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode engine: blocks reserved, the prompt cache in transfer
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int  # max_tokens, capped so prompt + output fits the model length
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    sample_index: int = 0  # which of the parent's n samples this is
    fork_of: Request | None = None  # sibling whose prompt cache this one will share
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    resume_point: int = 0  # a prefix-cache hit's first uncached position; paged state below it is shared
    num_pending: int = 0  # async scheduling: tokens sampled by steps in flight, not appended yet
    grammar: Any = None  # structured outputs: this sample's RequestGrammar (deepinfer.structured.manager)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed after the last step, unverified
    spec_confidence: list[float] | None = None  # the proposer's predicted acceptance of each draft
    # Disaggregation: {"do_remote_decode": True} on a prefill engine; the prefill engine's kv_transfer_params
    # (remote_bootstrap, transfer_id) on a decode engine. None: colocated.
    kv_transfer: dict | None = None
    kv_transfer_params: dict | None = None  # prefill engine: what the decode engine is given, once held
    # Image inputs (multimodal.inputs.ImageSpan): spans of the prompt filled by the vision encoder. A prefill chunk
    # never ends inside one; the prefix cache keys a block by the images it overlaps.
    images: tuple = ()

    @property
    def sends_cache(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("do_remote_decode"))

    @property
    def receives_cache(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("remote_bootstrap"))

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed + self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids[start:] if start < p else []) + self.output_token_ids[max(start - p, 0):stop - p]

    @property
    def image_keys(self) -> tuple[tuple[int, int, str], ...]:
        """(offset, end, digest) per image span."""
        from deepinfer.multimodal.inputs import image_keys  # only requests with images get here

        return image_keys(self.images) if self.images else ()

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
