"""The proposer interface: after a step is verified, draft the next tokens of each request.

The model runner hands a proposer one `ProposeBatch` per step: for every request the step computed,
the positions that are now validly in the cache (rejected drafts excluded), the token that follows
each of them, and how many drafts it may propose. Proposers with a draft model keep its cache in
lock-step with the target's: they consume exactly those positions, so rolling back rejected drafts
is the same counter reset for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ProposeItem:
    request_id: str
    history: list[int]  # every token of the request after this step (prompt, outputs, new token)
    start: int  # first position computed this step
    num_valid: int  # positions [start, start + num_valid) are in the cache with their true tokens
    rows: list[int]  # the step's hidden-state rows of those positions
    block_ids: list[int]
    state_slot: int
    write_from: int  # paged state below this position is shared: never rewritten
    max_drafts: int  # 0: keep the draft cache in step only (e.g. a prefill chunk that does not sample)


@dataclass
class Draft:
    token_ids: list[int]
    confidence: list[float] | None = None  # predicted acceptance by position; None: no estimate


@dataclass
class ProposeBatch:
    items: list[ProposeItem]
    hidden: torch.Tensor | None = None  # target hidden states of the step, what `Proposer.hidden_kind` asks for
    block_size: int = 0
    extra: dict = field(default_factory=dict)


class Proposer:
    """Drafts tokens; `hidden_kind` names the target state it needs: "" none, "mtp" what MTP layer 0 takes
    (V4 final streams, V3 final hidden), "final" the final normed hidden states."""

    hidden_kind = ""
    graph_safe = True  # False: needs module hooks during the target forward (never run by a graph replay)

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        raise NotImplementedError
