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

from deepinfer.layers.gather import take_rows
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

    def keys(self, ring_flat: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The gather source: the ring rows read this step, then the new rows (what `index` numbers)."""
        if self.ring_rows.numel() == 0:  # fresh prompts only: nothing read from the ring
            return new
        return torch.cat([take_rows(ring_flat, self.ring_rows), new])

    def gather(self, ring_flat: torch.Tensor, new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return take_rows(self.keys(ring_flat, new), idx)

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


TILE_ROWS = 32  # queries per tile of a prompt chunk (layers.attention.tiled_sink_attention)
MIN_TILED_QUERIES = TILE_ROWS // 2  # a request with fewer queries this step is attended row by row


@dataclass
class TilePlan:
    """A step's prompt chunks cut into tiles of B consecutive queries of one request: every query of a tile
    attends within the same K positions ending at the tile's last row, gathered once per tile instead of W per
    query. K = B + min(W - 1, the latest tile start): a chunk near the start of its prompt gathers fewer
    positions, none below 0 that every tile would mask. Requests with fewer than MIN_TILED_QUERIES queries
    (decodes, verify steps) stay outside: `others` lists their tokens, attended over their own gathered keys."""

    tokens: torch.Tensor  # [nt, B] token row of each tile row; a padding row repeats its request's last query
    key_idx: torch.Tensor  # [nt, K] rows into the window gather source (RingSource.keys)
    key_valid: torch.Tensor  # [nt, B, K] key position in (query position - W, query position], and >= 0
    real_rows: torch.Tensor  # [n] flat tile rows that are queries of their own ...
    real_tokens: torch.Tensor  # [n] ... and their token rows
    others: torch.Tensor  # [T'] tokens outside tiles

    @property
    def last(self) -> torch.Tensor:
        """[nt] token row of each tile's last query (it sees the most compressed entries)."""
        return self.tokens[:, -1]


def tile_plan(meta: ForwardMeta, src: RingSource, window: int, rows: int | None = None,
              min_queries: int | None = None) -> TilePlan | None:
    """None when no request has min_queries queries this step (defaults: the module's TILE_ROWS and
    MIN_TILED_QUERIES, read per call). Host lists and index arithmetic only."""
    rows, min_queries = rows or TILE_ROWS, min_queries or MIN_TILED_QUERIES
    lens, qs, dev = meta.query_lens(), meta.query_start, meta.device
    tiled = [r for r, n in enumerate(lens) if n >= min_queries]
    if not tiled:
        return None
    tiles = [(r, j) for r in tiled for j in range(0, lens[r], rows)]  # (request row, first query offset)
    req = torch.tensor([r for r, _ in tiles], device=dev)
    first = torch.tensor([qs[r] + j for r, j in tiles], device=dev)
    last = torch.tensor([qs[r + 1] - 1 for r, _ in tiles], device=dev)
    start = torch.tensor([meta.seq_starts[r] + j for r, j in tiles], device=dev)  # position of the first row
    span = rows + min(window - 1, max(meta.seq_starts[r] + j for r, j in tiles))
    offs = torch.arange(rows, device=dev)
    tokens = first[:, None] + offs
    real = (tokens <= last[:, None]).flatten()
    key_pos = start[:, None] + torch.arange(span, device=dev) - (span - rows)
    query_pos = start[:, None] + offs
    end_pos = start + (last - first)
    key_idx = src.index(req[:, None].expand_as(key_pos), torch.minimum(key_pos.clamp(min=0), end_pos[:, None]))
    kp, qp = key_pos[:, None, :], query_pos[:, :, None]
    key_valid = (kp >= 0) & (kp <= qp) & (kp > qp - window)
    real_rows = torch.nonzero(real).flatten()
    in_tiles = set(tiled)
    others = [t for r, n in enumerate(lens) if r not in in_tiles for t in range(qs[r], qs[r] + n)]
    return TilePlan(torch.minimum(tokens, last[:, None]), key_idx, key_valid, real_rows,
                    tokens.flatten()[real_rows], torch.tensor(others, dtype=torch.long, device=dev))
