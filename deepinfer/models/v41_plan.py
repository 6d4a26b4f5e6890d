"""Per-step index plans of DeepSeek-V4.1 attention: which keys each query reads, in which column order.

V4.1's sparse kernel runs an online softmax over blocks of 64 key columns, so the column order is part of the
numerics. The order reproduces the reference's two schedules:
  * a request whose step starts at position 0 (layout A): min(n, W) window columns, positions
    max(0, p - W + 1) + j (those after p invalid), then the compressed columns;
  * any later step (layout B): W window columns, positions p - W + 1 + j (negative ones invalid), then the
    compressed columns.
Compressed columns: the min(index_topk, E) entries picked for the query (E = the request's entries at the end
of the step), in entry order, the picks the query may not see last and invalid. Rows are padded at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.layers.metadata import ForwardMeta
from deepinfer.models.v4_plan import RingSource, ring_source


@dataclass
class WindowColumns:
    source: RingSource
    rows: torch.Tensor  # [T, W] rows into cat(ring rows, new rows) of each window column
    valid: torch.Tensor  # [T, W]
    width: torch.Tensor  # [T] window columns of the token's layout


def window_columns(meta: ForwardMeta, window: int, lookahead: int = 0,
                   floor: torch.Tensor | None = None) -> WindowColumns:
    """floor [R]: positions below it were never computed at this layer (prefill truncation): invalid keys."""
    src = ring_source(meta, window + lookahead)
    starts = torch.tensor(meta.seq_starts, dtype=torch.long, device=meta.device)[meta.token_req]
    lens = torch.tensor(meta.query_lens(), dtype=torch.long, device=meta.device)[meta.token_req]
    fresh = starts == 0  # layout A
    j = torch.arange(window, device=meta.device)[None, :]
    p = meta.positions[:, None]
    first = torch.where(fresh[:, None], (p - window + 1).clamp(min=0), p - window + 1)
    pos = first + j
    width = torch.where(fresh, lens.clamp(max=window), torch.full_like(lens, window))
    valid = (pos >= 0) & (pos <= p) & (j < width[:, None])
    if floor is not None:
        valid &= pos >= floor[meta.token_req][:, None]
    req = meta.token_req[:, None].expand_as(pos)
    rows = torch.where(valid, src.index(req, pos.clamp(min=0).minimum(p)), torch.zeros_like(pos))
    return WindowColumns(src, rows, valid, width)


def subset_columns(win: WindowColumns, keep: torch.Tensor) -> WindowColumns:
    """The columns of the kept rows (their keys gathered by the full step's plan)."""
    return WindowColumns(win.source, win.rows[keep], win.valid[keep], win.width[keep])


def truncation_floor(meta: ForwardMeta, keep_tokens: int) -> torch.Tensor | None:
    """Per request, the first prompt position the truncated layers compute (prompt - keep_tokens, at least 0);
    None when no request's prompt is longer than keep_tokens."""
    if keep_tokens <= 0 or meta.prompt_lens is None or max(meta.prompt_lens, default=0) <= keep_tokens:
        return None
    return torch.tensor([max(0, n - keep_tokens) for n in meta.prompt_lens], dtype=torch.long, device=meta.device)


def keep_rows(meta: ForwardMeta, floor: torch.Tensor) -> tuple[ForwardMeta, torch.Tensor]:
    """The step restricted to tokens at or past each request's floor: (sub-step, kept row indices). A request's
    kept tokens are contiguous, so the sub-step starts each request at max(start, floor)."""
    keep = torch.nonzero(meta.positions >= floor[meta.token_req]).flatten()
    floors = floor.tolist()
    starts = [min(max(s, f), e) for s, f, e in zip(meta.seq_starts, floors, meta.seq_lens)]
    qstart = [0]
    for s, e in zip(starts, meta.seq_lens):
        qstart.append(qstart[-1] + e - s)
    write_from = [max(w, s) for w, s in zip(meta.paged_write_from or meta.seq_starts, starts)]
    sub = replace(meta, input_ids=meta.input_ids[keep], positions=meta.positions[keep],
                  token_req=meta.token_req[keep], logits_indices=meta.logits_indices[:0], query_start=qstart,
                  seq_starts=starts, paged_write_from=write_from, scratch={}, images=None)
    return sub, keep


def pack_columns(win_keys: torch.Tensor, win: WindowColumns, comp_keys: torch.Tensor | None = None,
                 comp_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, C, d] and validity [T, C] in kernel column order: each row's window columns, then its compressed
    columns (comp_keys [T, K, d], comp_valid [T, K], valid ones first), padded at the end."""
    if comp_keys is None:
        return win_keys, win.valid
    t, w, k = win_keys.shape[0], win_keys.shape[1], comp_keys.shape[1]
    col = torch.arange(w + k, device=win_keys.device)[None, :].expand(t, -1)
    width = win.width[:, None]
    src = torch.where(col < width, col, w + col - width).clamp(max=w + k - 1)
    keys = torch.cat([win_keys, comp_keys], dim=1)
    valid = torch.cat([win.valid, comp_valid], dim=1)
    in_range = col < width + k
    idx = src.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    return keys.gather(1, idx), valid.gather(1, src) & in_range


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim, larger first, equal values by lower index."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level indexer: bool [..., E] of the entries inside each query's `topk_blocks` best
    blocks of `block` entries (a block scores its best entry; entries a query cannot see are -inf in `scores`),
    the block holding the query's newest visible entry always kept. `visible` [..., 1]: entries visible."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=-torch.inf)
    best = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    newest = (visible - 1) // block
    best = best.masked_fill(torch.arange(best.shape[-1], device=scores.device) == newest, torch.inf)
    values, picked = stable_topk(best, min(topk_blocks, best.shape[-1]))
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, picked, values > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]
