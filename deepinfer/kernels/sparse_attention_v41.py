"""DeepSeek-V4.1 sparse attention in Triton: window keys from the FP8 ring or the step's new rows, compressed entries
from the kv source's FP4 pool through the block table, and layers.attention.blocked_sink_attention's math.

One program per (query token, block of heads); every head reads the same keys (MQA, K is V). Invariants:
  * Column order is models/v41_plan.pack_columns': the token's `width` window columns (WindowColumns: layout A or
    B, the floor of prefill truncation included), then its compressed columns (entry ids in the given order,
    -1 = none, or entries 0..visible-1), padding last. The online softmax runs over blocks of SINK_BLOCK (64) of
    those columns in order -- blocked_sink_attention's partition -- so its rounding points fall on the same
    columns: float32 logits (dot, then x scale), the running max per block, probabilities rounded to bf16
    relative to it before the value product, float32 denominators, exp(sink - running max) added last.
  * Window column j of token t is row rows[t, j] of cat(ring[ring_rows], new_kv) (models/v4_plan.RingSource's
    gather), dereferenced here through ring_rows: the ring is read before the step writes it.
  * Entry e of the token's request is pool row block_table[req, e // per_block] * per_block + e % per_block. No
    [T, K, d] gather exists in memory; columns that are invalid are never loaded (holes, unused rows may be NaN).
  * Stored rows hold the QDQ points' values (layers/mx_quant.py): bf16, or packed codes + scales -- the window
    ring FP8 E4M3 with UE8M0 scales per 32, the pool E2M1 nibble pairs (low nibble first) with E4M3 scales per
    16 -- decoded in the kernel bit for bit (code x scale is exact in bf16), so both storages give equal keys.
  * Dots take bf16-valued operands and accumulate in float32: bf16 tensor-core dots when compiled, float32
    ("ieee") dots under the interpreter (its bf16 dot is inexact). Both float32 -> bf16 roundings (probabilities,
    output) are explicit round-to-nearest-even (the interpreter's cast truncates). The kernel thus departs from
    the torch reference only by float32 summation order and exp's last bit, which can move a probability across
    a bf16 rounding boundary (one bf16 ulp of it) and the output across one of its own; DeepSeek-V4.1's QDQ
    points amplify such ulps downstream (tests/test_kernels_v41.py measures it).
A token without valid columns attends to the sink alone: its output is 0. head_dim must be a multiple of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels import HAS_TRITON, interpreting, next_pow2
from deepinfer.layers.attention import SINK_BLOCK, blocked_sink_attention
from deepinfer.layers.mx_quant import MXStore, decode
from deepinfer.models.v41_plan import WindowColumns, pack_columns

if HAS_TRITON:
    import triton
    import triton.language as tl


@dataclass(frozen=True)
class V41Window:
    """A step's window keys where they live: the ring (before the step's write) and the step's new rows."""

    ring: torch.Tensor  # [ring rows, d] bf16 values, or uint8 FP8 E4M3 codes
    ring_scale: torch.Tensor | None  # [ring rows, d / 32] uint8 UE8M0 exponents; None: `ring` holds bf16
    ring_rows: torch.Tensor  # [Nr] int64 flat ring rows read this step (RingSource.ring_rows)
    new_kv: torch.Tensor  # [N, d] bf16, this step's FP8-QDQ'd rows
    rows: torch.Tensor  # [T, W] int64 rows into cat(ring[ring_rows], new_kv) (WindowColumns.rows)
    valid: torch.Tensor  # [T, W] bool
    width: torch.Tensor  # [T] int64 window columns of the token's layout


@dataclass(frozen=True)
class V41Entries:
    """The compressed entries a step attends: the kv source's pool, and which entries each token reads."""

    pool: torch.Tensor  # [blocks * per_block, d] bf16, or [.., d / 2] uint8 E2M1 pairs (low nibble first)
    pool_scale: torch.Tensor | None  # [.., d / 16] uint8 E4M3; None: `pool` holds bf16
    block_table: torch.Tensor  # [R, max_blocks] int64
    token_req: torch.Tensor  # [T] request row of each token
    per_block: int
    entry_ids: torch.Tensor | None = None  # [T, K] entry numbers in column order, -1 = none
    visible: torch.Tensor | None = None  # [T]: entries 0..visible-1 (used when entry_ids is None)


def window_source(ring: MXStore, ring_rows: torch.Tensor, new_kv: torch.Tensor, columns: WindowColumns) -> V41Window:
    """The V41Window of a layer's FP8 ring store, its step plan and this step's QDQ'd rows."""
    return V41Window(ring.data, ring.scales, ring_rows, new_kv, columns.rows, columns.valid, columns.width)


def entry_source(pool: MXStore, block_table: torch.Tensor, token_req: torch.Tensor, per_block: int,
                 picked: torch.Tensor, valid: torch.Tensor) -> V41Entries:
    """V41Entries of a kv source's FP4 store for picks [T, K] with validity [T, K] (the model's top-k)."""
    return V41Entries(pool.data, pool.scales, block_table, token_req, per_block,
                      entry_ids=torch.where(valid, picked, -1))


# ------------------------------------------------------------------------------------------------ reference


def _read(data: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """bf16 values of stored rows (MXStore.read on raw tensors)."""
    return data[rows] if scales is None else decode(data[rows], scales[rows], fmt)


def window_keys_reference(w: V41Window) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's gather: [T, W, d] window keys (invalid columns zero) and validity [T, W]."""
    keys = torch.cat([_read(w.ring, w.ring_scale, w.ring_rows, "fp8"), w.new_kv])[w.rows]
    return keys.masked_fill(~w.valid[..., None], 0), w.valid


def _entry_ids(e: V41Entries) -> torch.Tensor:
    if e.entry_ids is not None:
        return e.entry_ids
    n = int(e.visible.max()) if e.visible.numel() else 0
    ids = torch.arange(n, device=e.block_table.device)[None, :].expand(e.visible.numel(), -1)
    return torch.where(ids < e.visible[:, None], ids, -1)


def entry_keys_reference(e: V41Entries) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's gather: [T, K, d] compressed keys in column order (invalid ones zero) and validity [T, K]."""
    ids = _entry_ids(e)
    valid, safe = ids >= 0, ids.clamp(min=0)
    rows = e.block_table[e.token_req[:, None], safe // e.per_block] * e.per_block + safe % e.per_block
    keys = _read(e.pool, e.pool_scale, rows, "fp4_e4m3")
    return keys.masked_fill(~valid[..., None], 0), valid


def sparse_attention_v41_reference(q: torch.Tensor, window: V41Window, entries: V41Entries | None,
                                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """The model's torch path: gathered keys packed by pack_columns, then blocked_sink_attention. q [T, H, d] bf16
    -> [T, H, d] bf16."""
    win_keys, win_valid = window_keys_reference(window)
    columns = WindowColumns(None, window.rows, win_valid, window.width)
    comp_keys = comp_valid = None
    if entries is not None:
        comp_keys, comp_valid = entry_keys_reference(entries)
    keys, valid = pack_columns(win_keys, columns, comp_keys, comp_valid)
    return blocked_sink_attention(q, keys, valid, sinks, scale)


# --------------------------------------------------------------------------------------------------- kernel

if HAS_TRITON:

    @triton.jit
    def _e4m3(code):
        """int32 FP8 E4M3 codes (0..255, no NaN codes) -> float32, exactly."""
        sign, exp, man = code >> 7, (code >> 3) & 15, code & 7
        normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        subnormal = man.to(tl.float32) * 0.001953125  # man x 2^-9
        return tl.where(exp == 0, tl.where(sign != 0, -subnormal, subnormal), normal)

    @triton.jit
    def _ue8m0(code):
        """int32 UE8M0 exponents -> 2^(code - 127) in float32 (code 0: the subnormal 2^-127)."""
        return tl.where(code == 0, 1 << 22, code << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1(nibble):
        """int32 E2M1 codes (0..15) -> float32: +-{0, .5, 1, 1.5, 2, 3, 4, 6}."""
        exp, man = (nibble >> 1) & 3, nibble & 1
        pow2 = ((exp + 125) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 2)
        mag = tl.where(exp == 0, man.to(tl.float32) * 0.5, (2 + man).to(tl.float32) * pow2)
        return tl.where((nibble & 8) != 0, -mag, mag)

    @triton.jit
    def _bf16(x):
        """float32 -> the nearest bf16 value (ties to even), held in float32. Spelled out because the interpreter's
        float32 -> bf16 cast truncates (and ignores fp_downcast_rounding); compiled, this is the same RNE."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_window(ring_ptr, rscale_ptr, ring_rows_ptr, kv_ptr, cols_ptr, num_ring_rows, t, win_stride, cols,
                     is_win, dims, dmask, head_dim, PACKED: tl.constexpr):
        """Window keys [BLOCK_N, BLOCK_D] float32 of the block's window columns (zero elsewhere) and validity."""
        row = tl.load(cols_ptr + t * win_stride + cols, mask=is_win, other=-1)
        ok = row >= 0
        from_ring = ok & (row < num_ring_rows)
        from_new = ok & (row >= num_ring_rows)
        ring_row = tl.load(ring_rows_ptr + row, mask=from_ring, other=0)
        rmask = from_ring[:, None] & dmask[None, :]
        if PACKED:
            code = tl.load(ring_ptr + ring_row[:, None] * head_dim + dims[None, :], mask=rmask, other=0)
            exp = tl.load(rscale_ptr + ring_row[:, None] * (head_dim // 32) + dims[None, :] // 32, mask=rmask,
                          other=0)
            k_ring = _e4m3(code.to(tl.int32)) * _ue8m0(exp.to(tl.int32))
        else:
            k_ring = tl.load(ring_ptr + ring_row[:, None] * head_dim + dims[None, :], mask=rmask,
                             other=0.0).to(tl.float32)
        new_row = tl.where(from_new, row - num_ring_rows, 0)
        k_new = tl.load(kv_ptr + new_row[:, None] * head_dim + dims[None, :], mask=from_new[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
        return tl.where(from_ring[:, None], k_ring, k_new), ok

    @triton.jit
    def _load_entries(pool_ptr, pscale_ptr, bt_ptr, ids_ptr, req, t, num_ids, count, bt_stride, per_block, idx,
                      is_comp, dims, dmask, head_dim, PACKED: tl.constexpr, HAS_IDS: tl.constexpr):
        """Compressed keys [BLOCK_N, BLOCK_D] float32 of the block's compressed columns idx (zero elsewhere)."""
        if HAS_IDS:
            e = tl.load(ids_ptr + t * num_ids + idx, mask=is_comp & (idx < num_ids), other=-1)
        else:
            e = tl.where(is_comp & (idx < count), idx, -1)
        ok = e >= 0
        es = tl.where(ok, e, 0)
        block = tl.load(bt_ptr + req * bt_stride + es // per_block, mask=ok, other=0)
        row = block * per_block + es % per_block
        lmask = ok[:, None] & dmask[None, :]
        if PACKED:
            byte = tl.load(pool_ptr + row[:, None] * (head_dim // 2) + dims[None, :] // 2, mask=lmask, other=0)
            nibble = (byte.to(tl.int32) >> ((dims[None, :] % 2) * 4)) & 15
            scale = tl.load(pscale_ptr + row[:, None] * (head_dim // 16) + dims[None, :] // 16, mask=lmask, other=0)
            k = _e2m1(nibble) * _e4m3(scale.to(tl.int32))
        else:
            k = tl.load(pool_ptr + row[:, None] * head_dim + dims[None, :], mask=lmask, other=0.0).to(tl.float32)
        return k, ok

    @triton.jit
    def _blocked_update(q, k, ok, m, den, acc, scale, BF16_DOT: tl.constexpr):
        """One SINK_BLOCK of columns (keys k [N, D] float32 holding bf16 values, zero where not ok) into the running
        max m, denominator den and accumulator acc, as blocked_sink_attention orders it."""
        if BF16_DOT:
            logits = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")
        logits = tl.where(ok[None, :], logits, float("-inf")) * scale
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        if BF16_DOT:
            pv = tl.dot(_bf16(p).to(tl.bfloat16), k.to(tl.bfloat16))
        else:
            pv = tl.dot(_bf16(p), k, input_precision="ieee")
        return m_new, den, acc * alpha[:, None] + pv

    @triton.jit
    def _sparse_attention_v41_kernel(
        q_ptr, out_ptr, sink_ptr, ring_ptr, rscale_ptr, ring_rows_ptr, kv_ptr, cols_ptr, width_ptr,
        pool_ptr, pscale_ptr, bt_ptr, req_ptr, ids_ptr, vis_ptr,
        num_heads, head_dim, num_ring_rows, win_stride, per_block, bt_stride, num_ids, scale,
        HAS_ENTRIES: tl.constexpr, HAS_IDS: tl.constexpr, RING_PACKED: tl.constexpr, POOL_PACKED: tl.constexpr,
        BF16_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)  # t * H * d passes 2^31 in long prefill chunks
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        hmask, dmask = heads < num_heads, dims < head_dim
        q_off = (t * num_heads + heads)[:, None] * head_dim + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        m = tl.full([BLOCK_H], -1e30, tl.float32)
        den = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        width = tl.load(width_ptr + t)
        req = 0
        count = 0
        if HAS_ENTRIES:
            req = tl.load(req_ptr + t)
            count = num_ids if HAS_IDS else tl.load(vis_ptr + t)
        for c0 in range(0, width + count, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            is_win = cols < width
            k, ok = _load_window(ring_ptr, rscale_ptr, ring_rows_ptr, kv_ptr, cols_ptr, num_ring_rows, t, win_stride,
                                 cols, is_win, dims, dmask, head_dim, RING_PACKED)
            if HAS_ENTRIES:
                k_c, ok_c = _load_entries(pool_ptr, pscale_ptr, bt_ptr, ids_ptr, req, t, num_ids, count, bt_stride,
                                          per_block, cols - width, ~is_win, dims, dmask, head_dim, POOL_PACKED, HAS_IDS)
                k = tl.where(is_win[:, None], k, k_c)
                ok = tl.where(is_win, ok, ok_c)
            m, den, acc = _blocked_update(q, k, ok, m, den, acc, scale, BF16_DOT)
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        out = acc / (den + tl.exp(sink - m))[:, None]  # the sink: one more logit, valueless, against the running max
        tl.store(out_ptr + q_off, _bf16(out).to(tl.bfloat16), mask=hmask[:, None] & dmask[None, :])


def _nonempty(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """t, or a one-element stand-in where a launch would get a null / absent pointer (never dereferenced)."""
    return dummy if t is None or t.numel() == 0 else t.contiguous()


def _entry_args(e: V41Entries | None, dummy: torch.Tensor) -> tuple:
    """(pool, pool scale, block table, token req, ids, visible, per_block, bt stride, num ids) for the launch."""
    if e is None:
        return dummy, dummy, dummy, dummy, dummy, dummy, 1, 0, 0
    num_ids = e.entry_ids.shape[1] if e.entry_ids is not None else 0
    bt = e.block_table.contiguous()
    return (e.pool, _nonempty(e.pool_scale, dummy), bt, e.token_req.contiguous(), _nonempty(e.entry_ids, dummy),
            _nonempty(e.visible, dummy), e.per_block, bt.stride(0), num_ids)


def sparse_attention_v41(q: torch.Tensor, window: V41Window, entries: V41Entries | None, sinks: torch.Tensor,
                         scale: float, block_h: int = 16, num_warps: int = 4) -> torch.Tensor:
    """The Triton kernel; same contract as sparse_attention_v41_reference (q [T, H, d] bf16 -> bf16). Decode and
    prefill chunks alike: every query token is its own program."""
    t, h, d = q.shape
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if t == 0:
        return out
    if d % 32:
        raise ValueError(f"head_dim {d} must be a multiple of 32 (the FP8 ring's scale blocks)")
    dummy = torch.zeros(1, dtype=torch.int64, device=q.device)
    cols = torch.where(window.valid, window.rows, -1).contiguous()
    pool, pscale, bt, req, ids, vis, per_block, bt_stride, num_ids = _entry_args(entries, dummy)
    block_h = max(16, min(next_pow2(h), block_h))
    grid = (t, triton.cdiv(h, block_h))
    _sparse_attention_v41_kernel[grid](
        q.contiguous(), out, sinks.contiguous(), window.ring, _nonempty(window.ring_scale, dummy),
        _nonempty(window.ring_rows, dummy), window.new_kv.contiguous(), cols, window.width.contiguous(),
        pool, pscale, bt, req, ids, vis,
        h, d, window.ring_rows.numel(), cols.shape[1], per_block, bt_stride, num_ids, scale,
        HAS_ENTRIES=entries is not None, HAS_IDS=entries is not None and entries.entry_ids is not None,
        RING_PACKED=window.ring_scale is not None, POOL_PACKED=entries is not None and entries.pool_scale is not None,
        BF16_DOT=not interpreting(), BLOCK_H=block_h, BLOCK_N=SINK_BLOCK, BLOCK_D=max(next_pow2(d), 16),
        num_warps=num_warps,
    )
    return out
