"""Lightning Indexer scoring and exact top-k over paged indexer keys (DeepSeek-V4 CSA layers, V3.2 DSA).

Query token t (of request ``token_req[t]``) sees entries ``e < n_t`` with ``n_t = clamp(visible[t], 0, cap)``,
``cap = block_table.shape[1] * per_block``. Entry e lives in pool row
``block_table[token_req[t], e // per_block] * per_block + e % per_block`` (V4: ``visible = (pos + 1) // ratio``,
``per_block = block_size // ratio``; V3.2: one key per token, ``visible = pos + 1``, ``per_block = block_size``).
Keys dequantise as ``keys_pool.float() * keys_scale`` (float32 per-row scale of fp8/int8 pools).

Invariants (kernel and torch reference alike):
  - ``scores[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) * scale`` in float32 for ``e < n_t`` and ``-inf`` for
    every other column; ``w`` already carries ``n_heads ** -0.5`` and ``scale`` defaults to ``head_dim ** -0.5``.
    Pool rows of entries ``e >= n_t`` (and block-table slots past them) are never read.
  - top-k keeps exactly ``min(n_t, topk)`` entries: the largest scores, ties to the lower entry number (a stable
    descending sort), ``-0.0 == +0.0``, NaN above everything (as torch.sort ranks it). Entries ``e >= n_t`` are
    never selected. ``indices [T, topk]`` int64 lists the kept entry numbers ascending, padded with ``-1``;
    ``valid = indices >= 0``.

Kernel 1 gathers keys through the block table inside the program (one program per query token and block of
entries; no [T, E, d] gather in memory) and reduces heads with ``tl.dot`` in IEEE float32. Kernel 2 (one program
per query row) maps each score to an order-preserving int32, packs ``(key << 32) | (0xFFFFFFFF - e)`` into a
unique int64, bisects the key range for the k-th largest key (each step counts keys >= the midpoint, a block at
a time), and compacts the entries with keys >= it with ``tl.cumsum``: exact and deterministic.

The launchers (indexer_scores, select_topk, indexer_topk) always run the kernels and need Triton; callers gate on
``deepinfer.kernels.triton_enabled`` and otherwise use the ``*_reference`` functions, which share their contracts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import HAS_TRITON, next_pow2

_BLOCK_E = 64  # entries per scoring program
_BLOCK_ROW = 256  # entries per step of the top-k row scans

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _entry_rows(bt_row, e, live, per_block, stride_bb):
        """Pool rows (int64) of entries e through one request's block-table row; 0 where not live."""
        blk = tl.load(bt_row + (e // per_block) * stride_bb, mask=live, other=0).to(tl.int64)
        return tl.where(live, blk * per_block + e % per_block, 0)

    @triton.jit
    def _load_keys(k_ptr, ks_ptr, rows, live, stride_kn, stride_kd, stride_ks, D, BLOCK_D: tl.constexpr,
                   HAS_SCALE: tl.constexpr):
        """[BLOCK_E, BLOCK_D] float32 keys of the live rows (zeros elsewhere), dequantised."""
        d = tl.arange(0, BLOCK_D)
        mask = live[:, None] & (d[None, :] < D)
        ptrs = k_ptr + rows[:, None] * stride_kn + d[None, :] * stride_kd
        k = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            k = k * tl.load(ks_ptr + rows * stride_ks, mask=live, other=0.0).to(tl.float32)[:, None]
        return k

    @triton.jit
    def _head_block(q_row, w_row, keys, h0, H, D, stride_qh, stride_qd, stride_wh, scale, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        """[BLOCK_E] sum over heads h0..h0+BLOCK_H-1 of w[h] * relu(q[h] . k) * scale."""
        h = h0 + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ptrs = q_row + h[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(ptrs, mask=(h[:, None] < H) & (d[None, :] < D), other=0.0)
        dots = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")  # [BLOCK_H, BLOCK_E]
        w = tl.load(w_row + h * stride_wh, mask=h < H, other=0.0).to(tl.float32)
        return tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, vis_ptr, out_ptr,
                       stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn, stride_kd, stride_ks,
                       stride_br, stride_bb, stride_ot, H, D, E, cap, per_block, scale, HAS_SCALE: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        n = tl.maximum(tl.minimum(tl.load(vis_ptr + t).to(tl.int64), cap), 0)
        live = e < n
        bt_row = bt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_br
        rows = _entry_rows(bt_row, e, live, per_block, stride_bb)
        keys = _load_keys(k_ptr, ks_ptr, rows, live, stride_kn, stride_kd, stride_ks, D, BLOCK_D, HAS_SCALE)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            acc += _head_block(q_ptr + t * stride_qt, w_ptr + t * stride_wt, keys, h0, H, D, stride_qh, stride_qd,
                               stride_wh, scale, BLOCK_H, BLOCK_D)
        tl.store(out_ptr + t * stride_ot + e, tl.where(live, acc, float("-inf")), mask=e < E)

    @triton.jit
    def _row_keys(row, e, live):
        """Unique int64 keys, larger = ranked first: order-preserving score bits << 32 | (0xFFFFFFFF - e)."""
        s = tl.load(row + e, mask=live, other=0.0)
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0
        b = s.to(tl.int32, bitcast=True)
        ordered = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        ordered = tl.where(s != s, 0x7FFFFFFF, ordered)  # every NaN ranks first, as in torch.sort
        low = tl.full(e.shape, 4294967295, tl.int64) - e.to(tl.int64)
        return (ordered.to(tl.int64) << 32) | low

    @triton.jit
    def _key_range(row, n, BLOCK: tl.constexpr):
        """(min, max) of the row's keys over entries < n."""
        lo = tl.full([BLOCK], 9223372036854775807, tl.int64)
        hi = tl.full([BLOCK], -9223372036854775808, tl.int64)
        for start in range(0, n, BLOCK):
            e = start + tl.arange(0, BLOCK)
            key = _row_keys(row, e, e < n)
            lo = tl.where(e < n, tl.minimum(lo, key), lo)
            hi = tl.where(e < n, tl.maximum(hi, key), hi)
        return tl.min(lo, axis=0), tl.max(hi, axis=0)

    @triton.jit
    def _count_at_least(row, n, thr, BLOCK: tl.constexpr):
        """How many entries < n have keys >= thr."""
        count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            e = start + tl.arange(0, BLOCK)
            count += ((e < n) & (_row_keys(row, e, e < n) >= thr)).to(tl.int32)
        return tl.sum(count, axis=0)

    @triton.jit
    def _kth_key(row, n, k, BLOCK: tl.constexpr):
        """The k-th largest key of the row (its smallest key when n <= k): the largest thr with count >= k."""
        lo, hi = _key_range(row, n, BLOCK)
        hi = tl.where(n > k, hi, lo)
        while lo < hi:
            mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow
            enough = _count_at_least(row, n, mid, BLOCK) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        return lo

    @triton.jit
    def _compact(row, n, thr, out_row, BLOCK: tl.constexpr):
        """Writes the entries < n with keys >= thr to out_row ascending; returns how many."""
        base = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            e = start + tl.arange(0, BLOCK)
            sel = (e < n) & (_row_keys(row, e, e < n) >= thr)
            pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out_row + pos, e.to(tl.int64), mask=sel)
            base += tl.sum(sel.to(tl.int32), axis=0)
        return base

    @triton.jit
    def _topk_kernel(s_ptr, vis_ptr, out_ptr, stride_st, stride_ot, E, k, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        row, out_row = s_ptr + t * stride_st, out_ptr + t * stride_ot
        n = tl.maximum(tl.minimum(tl.load(vis_ptr + t).to(tl.int64), E), 0)
        count = _compact(row, n, _kth_key(row, n, k, BLOCK), out_row, BLOCK)
        for start in range(0, k, BLOCK):
            j = start + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= count) & (j < k))


def _need_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs Triton; use {name}_reference")


def _num_entries(visible: torch.Tensor, cap: int, max_entries: int | None) -> int:
    """Score columns: max_entries, else the largest visible count (at least 1, at most cap); syncs then."""
    if max_entries is not None:  # may be symbolic (a compiled step's table width): no int(), no guard
        return max_entries
    top = int(visible.max()) if visible.numel() else 0
    return max(min(top, cap), 1)


def _launch_scores(q: torch.Tensor, weights: torch.Tensor, keys_pool: torch.Tensor, keys_scale: torch.Tensor | None,
                   block_table: torch.Tensor, token_req: torch.Tensor, visible: torch.Tensor, per_block: int,
                   scale: float, n_cols: int) -> torch.Tensor:
    t, h, d = q.shape
    out = torch.empty(t, n_cols, dtype=torch.float32, device=q.device)
    ks = keys_pool if keys_scale is None else keys_scale
    grid = (t, triton.cdiv(n_cols, _BLOCK_E))
    _scores_kernel[grid](
        q, weights, keys_pool, ks, block_table, token_req, visible, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), keys_pool.stride(0),
        keys_pool.stride(1), ks.stride(0),
        block_table.stride(0), block_table.stride(1), out.stride(0),
        h, d, n_cols, block_table.shape[1] * per_block, per_block, scale, HAS_SCALE=keys_scale is not None,
        BLOCK_E=_BLOCK_E, BLOCK_H=min(max(next_pow2(h), 16), 64), BLOCK_D=max(next_pow2(d), 16))
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys_pool: torch.Tensor, keys_scale: torch.Tensor | None,
                   block_table: torch.Tensor, token_req: torch.Tensor, visible: torch.Tensor, per_block: int,
                   scale: float | None = None, *, max_entries: int | None = None) -> torch.Tensor:
    """Index scores [T, E] float32 (E = max_entries or the largest visible count), -inf past each n_t.

    q [T, H, d] (any strides), weights [T, H] float32 (n_heads**-0.5 included), keys_pool [N, d],
    keys_scale [N, 1] float32 or None, block_table [R, max_blocks], token_req [T], visible [T]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n_cols = _num_entries(visible, block_table.shape[1] * per_block, max_entries)
    _need_triton("indexer_scores")
    if q.shape[0] == 0:
        return torch.empty(0, n_cols, dtype=torch.float32, device=q.device)
    return _launch_scores(q, weights, keys_pool, keys_scale, block_table, token_req.contiguous(),
                          visible.contiguous(), per_block, scale, n_cols)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row's first n_t = clamp(visible, 0, E) columns of scores [T, E] (float32).

    Returns (indices [T, topk] int64 ascending, -1 padded; valid [T, topk] bool)."""
    _need_triton("select_topk")
    t = scores.shape[0]
    out = torch.empty(t, topk, dtype=torch.int64, device=scores.device)
    if t and topk:
        scores = scores.float().contiguous()
        _topk_kernel[(t,)](scores, visible.contiguous(), out, scores.stride(0), out.stride(0), scores.shape[1], topk,
                           BLOCK=_BLOCK_ROW)
    return out, out >= 0


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys_pool: torch.Tensor, keys_scale: torch.Tensor | None,
                 block_table: torch.Tensor, token_req: torch.Tensor, visible: torch.Tensor, per_block: int,
                 topk: int, scale: float | None = None, *,
                 max_entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k visible entry numbers of each query token: (indices [T, topk] int64 ascending, -1 padded;
    valid [T, topk] bool). Arguments as indexer_scores."""
    scores = indexer_scores(q, weights, keys_pool, keys_scale, block_table, token_req, visible, per_block, scale,
                            max_entries=max_entries)
    return select_topk(scores, visible.clamp(max=block_table.shape[1] * per_block), topk)


# ---------------------------------------------------------------------------------------------- torch reference


def gather_entry_rows(block_table: torch.Tensor, token_req: torch.Tensor, visible: torch.Tensor, per_block: int,
                      n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows [T, E] of each token's entries (clamped to its last visible one, as the model's plan does) and
    their validity [T, E]."""
    cap = block_table.shape[1] * per_block
    n = visible.long().clamp(0, cap)
    e = torch.arange(n_cols, device=block_table.device)[None, :].expand(n.numel(), -1)
    valid = e < n[:, None]
    e_safe = torch.minimum(e, (n[:, None] - 1).clamp(min=0)).clamp(max=cap - 1)
    blocks = block_table[token_req.long()[:, None].expand_as(e), e_safe // per_block].long()
    return blocks * per_block + e_safe % per_block, valid


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, keys_pool: torch.Tensor,
                             keys_scale: torch.Tensor | None, block_table: torch.Tensor, token_req: torch.Tensor,
                             visible: torch.Tensor, per_block: int, scale: float | None = None, *,
                             max_entries: int | None = None) -> torch.Tensor:
    """indexer_scores in torch: gather, then score as models/deepseek_v4.py's Indexer.select does."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n_cols = _num_entries(visible, block_table.shape[1] * per_block, max_entries)
    rows, valid = gather_entry_rows(block_table, token_req, visible, per_block, n_cols)
    keys = keys_pool[rows].float()
    if keys_scale is not None:
        keys = keys * keys_scale.float()[rows]
    scores = F.relu(torch.einsum("thd,ted->the", q.float(), keys)) * scale
    scores = (scores * weights.float()[..., None]).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


def select_topk_reference(scores: torch.Tensor, visible: torch.Tensor,
                          topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_topk in torch: stable descending sort, the first min(topk, E), valid ones ascending, -1 padded.
    The scores are padded by topk invalid columns first, so the output is [T, topk] without a min() over the
    column count (a compiled step's width is symbolic: no guard, no recompile as tables grow)."""
    width = scores.shape[1] + topk
    cols = torch.arange(width, device=scores.device)[None, :]
    valid = cols < visible.long().clamp(min=0, max=scores.shape[1])[:, None]
    ranked = torch.nn.functional.pad(scores.float(), (0, topk)).masked_fill(~valid, float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.sort(torch.where(valid.gather(1, order), order, width), dim=1).values
    out = chosen.masked_fill(chosen == width, -1)
    return out, out >= 0


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, keys_pool: torch.Tensor,
                           keys_scale: torch.Tensor | None, block_table: torch.Tensor, token_req: torch.Tensor,
                           visible: torch.Tensor, per_block: int, topk: int, scale: float | None = None, *,
                           max_entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_topk in torch (the tests' oracle)."""
    scores = indexer_scores_reference(q, weights, keys_pool, keys_scale, block_table, token_req, visible,
                                      per_block, scale, max_entries=max_entries)
    return select_topk_reference(scores, visible.clamp(max=block_table.shape[1] * per_block), topk)
