"""DeepSeek-V4 / V4.1 sparse attention over the paged pools: window ring + compressed entries + sink, in Triton.

One program per (query token, block of heads). Its keys, all shared by every head (MQA, K is V), come from:
  1. the sliding window: positions p in [pos - W + 1, pos], p >= 0. Positions below the request's computed
     count `start` are read from the ring (row slot * L + p % L, written in earlier steps); later ones are this
     step's new rows (row qstart + p - start). The ring is read before this step writes it.
  2. compressed entries (CSA / HCA layers): entry numbers, either a per-token list (CSA top-k, -1 = none) or
     all entries below a per-token count (HCA); entry e of the token's request sits at pool row
     block_table[req, e // per_block] * per_block + e % per_block, so nothing is gathered in memory.
  3. the per-head sink logit, in the softmax denominator only.
The softmax is online over blocks of keys in float32; a token with no keys attends only to the sink (output 0).
Quantised pools (fp8 / int8) are dequantised per row with their float32 scale as they are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels import HAS_TRITON, next_pow2
from deepinfer.layers.attention import sink_attention

if HAS_TRITON:
    import triton
    import triton.language as tl


@dataclass(frozen=True)
class WindowSource:
    """Where a step's window keys live: the ring (before the step's write) and the step's new rows."""

    ring: torch.Tensor  # [slots * ring_len, d]
    ring_len: int
    window: int
    new_kv: torch.Tensor  # [T, d]
    token_slot: torch.Tensor  # [T] state slot of the token's request
    token_start: torch.Tensor  # [T] tokens of the request computed before this step
    token_qstart: torch.Tensor  # [T] first new row of the request
    positions: torch.Tensor  # [T]


@dataclass(frozen=True)
class EntrySource:
    """Compressed entries of a step: the pool, its scales, and which entries each token attends."""

    pool: torch.Tensor  # [blocks * per_block, d]
    scale: torch.Tensor | None  # [blocks * per_block, 1] float32 for quantised pools
    block_table: torch.Tensor  # [R, max_blocks]
    token_req: torch.Tensor  # [T]
    per_block: int
    entry_ids: torch.Tensor | None = None  # [T, K] entry numbers, -1 = none (CSA top-k)
    visible: torch.Tensor | None = None  # [T] entries 0..visible-1 (HCA)


# ------------------------------------------------------------------------------------------------ reference


def _window_keys_reference(w: WindowSource) -> tuple[torch.Tensor, torch.Tensor]:
    pos = w.positions[:, None] + torch.arange(w.window, device=w.new_kv.device)[None, :] - (w.window - 1)
    valid = pos >= 0
    pos = pos.clamp(min=0)
    from_ring = w.token_slot[:, None] * w.ring_len + pos % w.ring_len
    from_new = (w.token_qstart[:, None] + pos - w.token_start[:, None]).clamp(0, w.new_kv.shape[0] - 1)
    in_ring = pos < w.token_start[:, None]
    keys = torch.where(in_ring[..., None], w.ring[from_ring], w.new_kv[from_new])
    return keys, valid


def _entry_ids(e: EntrySource) -> torch.Tensor:
    if e.entry_ids is not None:
        return e.entry_ids
    n = e.block_table.shape[1] * e.per_block  # every entry the table can name: a shape from no data
    ids = torch.arange(n, device=e.pool.device)[None, :].expand(e.visible.numel(), -1)
    return torch.where(ids < e.visible[:, None], ids, -1)


def _entry_keys_reference(e: EntrySource, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _entry_ids(e)
    valid, safe = ids >= 0, ids.clamp(min=0)
    rows = e.block_table[e.token_req[:, None], safe // e.per_block] * e.per_block + safe % e.per_block
    keys = e.pool[rows].float()
    if e.scale is not None:
        keys = keys * e.scale[rows]
    return keys.to(dtype).masked_fill(~valid[..., None], 0), valid


def sparse_attention_reference(q: torch.Tensor, window: WindowSource, entries: EntrySource | None,
                               sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """The model's math (gather, then layers.attention.sink_attention). q [T, H, d] -> [T, H, d]."""
    keys, valid = _window_keys_reference(window)
    if entries is not None:
        extra, extra_valid = _entry_keys_reference(entries, keys.dtype)
        keys, valid = torch.cat([keys, extra], 1), torch.cat([valid, extra_valid], 1)
    return sink_attention(q, keys, valid, sinks, scale)


# --------------------------------------------------------------------------------------------------- kernel

if HAS_TRITON:

    @triton.jit
    def _online_update(q, k, ok, m, den, acc, scale):
        """One block of keys k [N, D] (ok [N]) into the running max m, denominator den and accumulator acc."""
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee")
        return m_new, den, acc

    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, out_ptr, sink_ptr, kv_ptr, ring_ptr, slot_ptr, start_ptr, qstart_ptr, pos_ptr,
        pool_ptr, pscale_ptr, bt_ptr, req_ptr, ids_ptr, vis_ptr,
        num_heads, head_dim, window, ring_len, per_block, bt_stride, num_ids, scale,
        HAS_ENTRIES: tl.constexpr, HAS_IDS: tl.constexpr, HAS_SCALE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)  # t * H * d passes 2^31 in long prefill chunks
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        hmask, dmask = heads < num_heads, dims < head_dim
        q_off = (t * num_heads + heads)[:, None] * head_dim + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=hmask[:, None] & dmask[None, :], other=0.0)
        m = tl.full([BLOCK_H], -1e30, tl.float32)
        den = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        pos = tl.load(pos_ptr + t)
        start = tl.load(start_ptr + t)
        ring_base = tl.load(slot_ptr + t) * ring_len
        new_base = tl.load(qstart_ptr + t) - start
        for j0 in range(0, window, BLOCK_N):
            p = pos - window + 1 + j0 + tl.arange(0, BLOCK_N)
            ok = (p >= 0) & (j0 + tl.arange(0, BLOCK_N) < window)
            in_ring = p < start
            ring_row = ring_base + tl.where(p >= 0, p, 0) % ring_len
            row_off = tl.where(in_ring, ring_row, new_base + p)[:, None] * head_dim + dims[None, :]
            lmask = ok[:, None] & dmask[None, :]
            k_ring = tl.load(ring_ptr + row_off, mask=lmask & in_ring[:, None], other=0.0)
            k_new = tl.load(kv_ptr + row_off, mask=lmask & ~in_ring[:, None], other=0.0)
            k = tl.where(in_ring[:, None], k_ring, k_new).to(q.dtype)
            m, den, acc = _online_update(q, k, ok, m, den, acc, scale)
        if HAS_ENTRIES:
            req = tl.load(req_ptr + t)
            count = num_ids if HAS_IDS else tl.load(vis_ptr + t)
            for e0 in range(0, count, BLOCK_N):
                idx = e0 + tl.arange(0, BLOCK_N)
                if HAS_IDS:
                    e = tl.load(ids_ptr + t * num_ids + idx, mask=idx < num_ids, other=-1)
                else:
                    e = tl.where(idx < count, idx, -1)
                ok = e >= 0
                es = tl.where(ok, e, 0)
                block = tl.load(bt_ptr + req * bt_stride + es // per_block, mask=ok, other=0)
                row = block * per_block + es % per_block
                k = tl.load(pool_ptr + row[:, None] * head_dim + dims[None, :],
                            mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                if HAS_SCALE:
                    k = k * tl.load(pscale_ptr + row, mask=ok, other=0.0)[:, None]
                m, den, acc = _online_update(q, k.to(q.dtype), ok, m, den, acc, scale)
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)  # the sink is one more logit, valueless
        alpha = tl.exp(m - top)
        out = acc * alpha[:, None] / (den * alpha + tl.exp(sink - top))[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


def _entry_args(e: EntrySource | None, dummy: torch.Tensor) -> tuple:
    """(pool, scale, block table, token req, ids, visible, per_block, bt stride, num ids) for the launch."""
    if e is None:
        return dummy, dummy, dummy, dummy, dummy, dummy, 1, 0, 0
    ids = e.entry_ids if e.entry_ids is not None else dummy
    num_ids = e.entry_ids.shape[1] if e.entry_ids is not None else 0
    vis = e.visible if e.visible is not None else dummy
    scale = e.scale if e.scale is not None else dummy
    return (e.pool, scale, e.block_table, e.token_req, ids.contiguous(), vis, e.per_block,
            e.block_table.stride(0), num_ids)


def sparse_attention(q: torch.Tensor, window: WindowSource, entries: EntrySource | None, sinks: torch.Tensor,
                     scale: float, block_h: int = 16, block_n: int = 32, num_warps: int = 4) -> torch.Tensor:
    """The Triton kernel; same contract as sparse_attention_reference. Works for decode (one query per
    request) and prefill chunks (several, each its own program) alike."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    dummy = torch.zeros(1, dtype=torch.int64, device=q.device)
    pool, pscale, bt, req, ids, vis, per_block, bt_stride, num_ids = _entry_args(entries, dummy)
    grid = (t, triton.cdiv(h, block_h))
    _sparse_attention_kernel[grid](
        q.contiguous(), out, sinks, window.new_kv.contiguous(), window.ring, window.token_slot,
        window.token_start, window.token_qstart, window.positions,
        pool, pscale, bt, req, ids, vis,
        h, d, window.window, window.ring_len, per_block, bt_stride, num_ids, scale,
        HAS_ENTRIES=entries is not None, HAS_IDS=entries is not None and entries.entry_ids is not None,
        HAS_SCALE=entries is not None and entries.scale is not None,
        BLOCK_H=max(block_h, 16), BLOCK_N=max(block_n, 16), BLOCK_D=max(next_pow2(d), 16), num_warps=num_warps,
    )
    return out
