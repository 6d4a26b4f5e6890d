"""DeepSeek-V4's per-step plans for a fixed-shape step (layers/static_step.py): what CUDA graphs replay.

Same meanings as v4_plan.py's plans, computed with no data-dependent shape and no host sync:
  - every token is a candidate compression window end; a token that ends no window (or a padding row)
    writes its entry to the scratch row, so the number of new entries is never needed;
  - a position p of token t's request is read from the ring (p < start, row slot * L + p % L) or from the
    step's new rows (row qstart + p - start), chosen per element;
  - every new token is written to its ring (q new tokens per request never exceed a ring's length).
The attention itself is the Triton kernels' (kernels/), which read keys through these indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.static_step import StaticStep


@dataclass
class StaticRing:
    """One ring length's reads and writes for a static step (RingSource's interface)."""

    ring_len: int
    step: StaticStep
    slot: torch.Tensor  # [T] state slot of each token's request

    def rows(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring row, new row, from_new) of positions pos [T, S] of each token's request."""
        step = self.step
        start, qstart = step.token_start[:, None], step.token_qstart[:, None]
        safe = pos.clamp(min=0)
        from_new = safe >= start
        new_row = (qstart + safe - start).clamp(0, step.input_ids.numel() - 1)
        return self.slot[:, None] * self.ring_len + safe % self.ring_len, new_row, from_new

    def gather(self, ring_flat: torch.Tensor, new: torch.Tensor, idx) -> torch.Tensor:
        ring_row, new_row, from_new = idx
        return torch.where(from_new[..., None], new[new_row], ring_flat[ring_row])

    def write(self, ring_flat: torch.Tensor, new: torch.Tensor) -> None:
        ring_flat[self.slot * self.ring_len + self.step.positions % self.ring_len] = new


@dataclass
class StaticWindow:
    source: StaticRing


@dataclass
class StaticCompress:
    """Compressor plan: one candidate window per token (CompressPlan's interface)."""

    ratio: int
    overlap: bool
    source: StaticRing
    slot_idx: tuple  # StaticRing.rows of each candidate window's positions [T, span]
    slot_valid: torch.Tensor  # [T, span]
    entry_dst: torch.Tensor  # [T] paged row of the entry, or the scratch row
    entry_pos: torch.Tensor  # [T] rope position of the entry
    max_entries: int  # entries a request can hold (the indexer's score width)

    @property
    def num_new(self) -> int:
        return self.entry_dst.numel()


def static_compress(step: StaticStep, ring: StaticRing, ratio: int, overlap: bool, scratch_block: int
                    ) -> StaticCompress:
    span = 2 * ratio if overlap else ratio
    pos = step.positions
    ends = (pos + 1) % ratio == 0
    w = ((pos + 1) // ratio - 1).clamp(min=0)
    window_pos = (w[:, None] - (1 if overlap else 0)) * ratio + torch.arange(span, device=step.device)[None, :]
    per_block = step.block_size // ratio
    dst = torch.where(ends, step.slots_of(step.token_req, w, ratio=ratio), scratch_block * per_block)
    return StaticCompress(ratio, overlap, ring, ring.rows(window_pos), window_pos >= 0, dst, w * ratio,
                          step.block_table.shape[1] * per_block)


class StaticRope:
    """A RotaryTable grown beforehand (to the longest position a graph may see): lookup is indexing."""

    def __init__(self, table):
        self.table = table

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table.cos[positions], self.table.sin[positions]
