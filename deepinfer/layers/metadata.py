"""Per-step forward metadata: the one object the model runner hands to a model.

A step runs a ragged batch: request r contributes tokens at positions
[seq_starts[r], seq_lens[r]) that sit, flattened, at rows [query_start[r], query_start[r+1]).
Positions below seq_starts[r] were computed in earlier steps and live in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch


def host_long(values, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 tensor of a (rectangular, possibly nested) list of ints. Through numpy: for a step's short lists this
    costs about a third of torch.tensor's type inference, paid several times per step on the host."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if torch.device(device).type == "cpu" else t.to(device)


@dataclass(frozen=True)
class CacheTensorSpec:
    """One cache tensor a model asks for.

    paged: allocated as [num_blocks, *shape]; block b holds the state of token positions
           [i * block_size, (i + 1) * block_size) of whichever request maps logical block i to b.
    state: allocated as [num_state_slots, *shape]; one slot per running request (bounded state).
    """

    name: str
    kind: Literal["paged", "state"]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_unit(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


# Token types inside an image span (multimodal.image_processor lays spans out; models embed them by type). Only
# IMAGE positions take encoder rows; the others take learned delimiter embeddings.
IMAGE_START, IMAGE_TYPE, IMAGE_NEWLINE, IMAGE_END = range(4)


@dataclass(frozen=True)
class ImageRows:
    """The step's tokens inside image spans: their rows, their span token types (image_processor: START, IMAGE,
    NEWLINE, END) and, for the IMAGE ones in row order, the encoder's features."""

    rows: torch.Tensor  # [M] int64 step rows, ascending
    types: torch.Tensor  # [M] int64
    features: torch.Tensor  # [count of IMAGE types, hidden]

    def mask(self, num_tokens: int) -> torch.Tensor:
        """bool [num_tokens], True at image-span rows."""
        out = torch.zeros(num_tokens, dtype=torch.bool, device=self.rows.device)
        return out.index_fill_(0, self.rows, True)

    def shifted(self, lo: int, hi: int) -> ImageRows | None:
        """The part inside rows [lo, hi), rebased to start at 0 (None if empty)."""
        inside = (self.rows >= lo) & (self.rows < hi)
        if not bool(inside.any()):
            return None
        is_image = self.types == IMAGE_TYPE
        feature_rows = torch.cumsum(is_image.long(), 0) - 1
        return ImageRows(self.rows[inside] - lo, self.types[inside], self.features[feature_rows[inside & is_image]])


@dataclass
class ForwardMeta:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64, batch row of each token
    block_table: torch.Tensor  # [R, max_blocks] int64, padded with 0
    state_slots: torch.Tensor  # [R] int64
    logits_indices: torch.Tensor  # [L] int64, rows whose logits are needed
    query_start: list[int]  # host, R + 1
    seq_starts: list[int]  # host, R: tokens already in the cache
    seq_lens: list[int]  # host, R: tokens in the cache after this step
    block_size: int
    # Per request: paged state of positions below this is a shared cached prefix and is not rewritten
    # (a prefix-cache hit recomputes some earlier tokens only to rebuild bounded state). None: seq_starts.
    paged_write_from: list[int] | None = None
    # Per request: prompt tokens (positions at or past it are generated ones). None: unknown (draft steps).
    prompt_lens: list[int] | None = None
    images: ImageRows | None = None  # image-span tokens of this step (a vision model's prompts); None: text only
    # Per-step derived tensors, computed once by the model and shared by its layers.
    scratch: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_starts)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_reqs

    def query_lens(self) -> list[int]:
        return [e - s for s, e in zip(self.query_start[:-1], self.query_start[1:])]

    def slots_of(self, req_rows: torch.Tensor, positions: torch.Tensor, entries_per_block: int = 0,
                 ratio: int = 1) -> torch.Tensor:
        """Flat index into a paged tensor viewed as [num_blocks * entries_per_block, ...].

        Entry e of a stream with one entry per `ratio` tokens covers token position e * ratio;
        positions here are entry numbers. `entries_per_block` defaults to block_size // ratio.
        """
        per_block = entries_per_block or self.block_size // ratio
        blocks = self.block_table[req_rows, positions // per_block]
        return blocks * per_block + positions % per_block

    def new_token_slots(self) -> torch.Tensor:
        """Flat paged index of every new token (one entry per token)."""
        return self.cached("new_token_slots", lambda: self.slots_of(self.token_req, self.positions))

    def cached(self, key: str, fn):
        if key not in self.scratch:
            self.scratch[key] = fn()
        return self.scratch[key]


def sub_meta(meta: ForwardMeta, lo: int, hi: int) -> ForwardMeta:
    """Requests [lo, hi) of meta as a batch of their own (rows and request indices rebased)."""
    a, b = meta.query_start[lo], meta.query_start[hi]
    write_from = None if meta.paged_write_from is None else meta.paged_write_from[lo:hi]
    prompt_lens = None if meta.prompt_lens is None else meta.prompt_lens[lo:hi]
    return ForwardMeta(
        input_ids=meta.input_ids[a:b], positions=meta.positions[a:b], token_req=meta.token_req[a:b] - lo,
        block_table=meta.block_table[lo:hi], state_slots=meta.state_slots[lo:hi],
        logits_indices=meta.logits_indices[:0], query_start=[q - a for q in meta.query_start[lo:hi + 1]],
        seq_starts=meta.seq_starts[lo:hi], seq_lens=meta.seq_lens[lo:hi], block_size=meta.block_size,
        paged_write_from=write_from, prompt_lens=prompt_lens,
        images=None if meta.images is None else meta.images.shifted(a, b))
