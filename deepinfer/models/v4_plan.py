"""Per-step index plans for DeepSeek-V4's bounded and compressed state.

Everything here is integer bookkeeping computed once per step from the ForwardMeta and shared by
all layers of the same kind, so layer code only gathers, computes and scatters.

Rings: a request's bounded per-token state (window KV, compressor inputs) lives in a ring of L
slots of its state slot; position p sits at slot p % L. Before a step the ring holds positions
[s - L, s) (s = tokens already computed), so the last L - 1 positions are always readable.
Reading "position p" during a step means: the ring if p < s, else the step's new row for p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.metadata import ForwardMeta


@dataclass
class RingSource:
    """Gather plan over cat(ring_flat[ring_rows], new_rows) for one ring length L."""

    ring_len: int
    ring_rows: torch.Tensor  # [Nr] flat rows of the ring state to read this step
    write_dst: torch.Tensor  # [Nw] flat ring rows to overwrite after the step's reads
    write_src: torch.Tensor  # [Nw] new-token rows that go there
    _base: torch.Tensor  # [R] offset of each request's ring rows inside ring_rows
    _lo: torch.Tensor  # [R] first ring position read for each request
    _start: torch.Tensor  # [R] tokens computed before this step
    _qstart: torch.Tensor  # [R] first new-token row of each request

    def index(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Row in cat(ring_flat[ring_rows], new) holding (request row, position); pos must be >= lo."""
        from_ring = self._base[req] + pos - self._lo[req]
        from_new = self.ring_rows.numel() + self._qstart[req] + pos - self._start[req]
        return torch.where(pos < self._start[req], from_ring, from_new)

    def gather(self, ring_flat: torch.Tensor, new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.cat([ring_flat[self.ring_rows], new])[idx]

    def write(self, ring_flat: torch.Tensor, new: torch.Tensor) -> None:
        ring_flat[self.write_dst] = new[self.write_src]


def ring_source(meta: ForwardMeta, ring_len: int) -> RingSource:
    dev = meta.device
    start = torch.tensor(meta.seq_starts, dtype=torch.long, device=dev)
    end = torch.tensor(meta.seq_lens, dtype=torch.long, device=dev)
    qstart = torch.tensor(meta.query_start[:-1], dtype=torch.long, device=dev)
    lo = (start - ring_len + 1).clamp(min=0)
    counts = start - lo
    base = torch.cumsum(counts, 0) - counts
    req_of = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
    pos = lo[req_of] + torch.arange(req_of.numel(), device=dev) - base[req_of]
    ring_rows = meta.state_slots[req_of] * ring_len + pos % ring_len
    keep = meta.positions >= end[meta.token_req] - ring_len
    write_dst = (meta.state_slots[meta.token_req] * ring_len + meta.positions % ring_len)[keep]
    write_src = torch.nonzero(keep).flatten()
    return RingSource(ring_len, ring_rows, write_dst, write_src, base, lo, start, qstart)


@dataclass
class WindowPlan:
    source: RingSource
    key_idx: torch.Tensor  # [T, W] rows into the window gather source
    key_valid: torch.Tensor  # [T, W]


def window_plan(meta: ForwardMeta, window: int, lookahead: int = 0) -> WindowPlan:
    """Keys of the query at position t are positions t - W + 1 .. t (those >= 0). The ring keeps
    `lookahead` extra positions so that rolling back that many tokens still finds every key."""
    src = ring_source(meta, window + lookahead)
    offsets = torch.arange(window, device=meta.device) - (window - 1)
    pos = meta.positions[:, None] + offsets[None, :]
    valid = pos >= 0
    req = meta.token_req[:, None].expand_as(pos)
    idx = torch.where(valid, src.index(req, pos.clamp(min=0)), torch.zeros_like(pos))
    return WindowPlan(src, idx, valid)


@dataclass
class CompressPlan:
    """Windows of `ratio` tokens completed in this step, and what each query may attend to."""

    ratio: int
    overlap: bool
    source: RingSource
    slot_idx: torch.Tensor  # [Nw, L] rows into the gather source; L = 2*ratio with overlap
    slot_valid: torch.Tensor  # [Nw, L] (positions < 0 are invalid)
    entry_dst: torch.Tensor  # [Nw] flat paged rows of the new entries
    entry_pos: torch.Tensor  # [Nw] rope position ratio * w of each new entry
    query_entries: torch.Tensor  # [T, E] flat paged rows of entries 0..E-1 for each query's request
    query_valid: torch.Tensor  # [T, E] entry w is visible to position t iff w < (t + 1) // ratio
    entry_req: torch.Tensor  # [Nw] request row of each new entry

    @property
    def num_new(self) -> int:
        return int(self.entry_dst.numel())

    @property
    def max_entries(self) -> int:
        """Entries the widest request of the step can see (the indexer's score width)."""
        return self.query_entries.shape[1]


def _completed_windows(meta: ForwardMeta, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request row, window index) of every window whose last token is computed this step, except
    windows inside a shared cached prefix (their entries are already in the shared blocks)."""
    dev = meta.device
    start = torch.tensor(meta.paged_write_from or meta.seq_starts, dtype=torch.long, device=dev)
    end = torch.tensor(meta.seq_lens, dtype=torch.long, device=dev)
    first, stop = start // ratio, torch.maximum(end // ratio, start // ratio)
    counts = stop - first
    req = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
    base = torch.cumsum(counts, 0) - counts
    w = first[req] + torch.arange(req.numel(), device=dev) - base[req]
    return req, w


def compress_plan(meta: ForwardMeta, ratio: int, overlap: bool, lookahead: int = 0) -> CompressPlan:
    span = 2 * ratio if overlap else ratio
    src = ring_source(meta, span + lookahead)
    req, w = _completed_windows(meta, ratio)
    pos = (w[:, None] - (1 if overlap else 0)) * ratio + torch.arange(span, device=meta.device)[None, :]
    valid = pos >= 0
    idx = torch.where(valid, src.index(req[:, None].expand_as(pos), pos.clamp(min=0)), torch.zeros_like(pos))
    entry_dst = meta.slots_of(req, w, ratio=ratio)
    q_entries, q_valid = _query_entries(meta, ratio)
    return CompressPlan(ratio, overlap, src, idx, valid, entry_dst, w * ratio, q_entries, q_valid, req)


def _query_entries(meta: ForwardMeta, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    visible = (meta.positions + 1) // ratio  # [T]
    n_max = max(int(visible.max()) if visible.numel() else 0, 1)
    w = torch.arange(n_max, device=meta.device)[None, :].expand(visible.numel(), -1)
    valid = w < visible[:, None]
    w_safe = torch.minimum(w, (visible[:, None] - 1).clamp(min=0))
    rows = meta.slots_of(meta.token_req[:, None].expand_as(w), w_safe, ratio=ratio)
    return rows, valid
