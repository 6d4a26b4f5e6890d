"""MLA (DeepSeek V2 / V3 / V3.2) absorbed paged decode attention, in Triton: one query token per request.

Contract (`mla_decode` and its torch definition `mla_decode_reference`):
  * q [R, H, latent + rope] is the absorbed query, [q_nope @ W_UK | rotated q_pe]; cache [N, latent + rope] the
    paged latent pool viewed as flat rows (``PagedPool.data``), N = num_blocks * block_size, last dim contiguous;
  * position p of request r lives at row block_table[r, p // block_size] * block_size + p % block_size; the
    rows are gathered inside the kernel (no [R, L, D] copy), block ids stay int64 so row offsets cannot overflow;
  * scale_rows [N, 1] float32 (fp8 / int8 pools) or None: a row's value is data.float() * scale. The kernel
    folds the row scale into that key's logit and probability (exact in real arithmetic) and feeds the raw fp8 /
    int8 values, exact in the dot's input type, to ``tl.dot``;
  * request r attends positions 0 .. seq_lens[r] - 1 (its new token included), restricted to attend[r] when the
    [R, L] bool mask (V3.2 DSA selection) is given; positions >= seq_len, or >= L of `attend`, never count and
    their rows (and scales) are never read. seq_lens[r] <= max_blocks * block_size is required (the kernel clamps
    to it, never reading past the block table);
  * o_c [R, H, latent] = softmax(softmax_scale * q . k) @ k[:, :latent], softmax in float32 (online, over blocks
    of BLOCK_N positions, in base 2), output in q's dtype; a request with nothing to attend (seq_len 0, empty
    selection) gets zeros.

Kernel layout: the grid is (request, block of BLOCK_H heads, context split). The latent (512 in real models) and
rope (64) parts are loaded as separate tiles padded to powers of two (masked), so both dots have pow2 shapes;
BLOCK_H, BLOCK_N >= 16 (``tl.dot``'s minimum), padded heads masked. With num_splits > 1 each split writes a
normalised partial output and its base-2 log-sum-exp, and a second small kernel merges them (split-K, so a small
batch still fills the GPU). Dots run in float32 ("ieee") for float32 queries and under the interpreter (whose
bf16 ``tl.dot`` is not exact), otherwise in q's 16-bit dtype with float32 accumulation. Callers gate on
``deepinfer.kernels.triton_enabled``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels import HAS_TRITON, interpreting, next_pow2
from deepinfer.layers.kv_quant import PagedPool

MIN_TILE = 16  # tl.dot needs every tile dimension >= 16
LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_SPLIT_POSITIONS = 256  # a split covers at least this many positions
MERGE_TILE = 128  # latent columns per merge program ([MAX_SPLITS, MERGE_TILE] float32 stays in registers)

if HAS_TRITON:
    import triton
    import triton.language as tl


# ------------------------------------------------------------------------------------------------ reference


def _positions(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row slots [R, length] of positions 0..length-1 (row of position 0 where invalid) and their validity."""
    pos = torch.arange(length, device=block_table.device)
    valid = pos[None] < seq_lens[:, None]
    p = torch.where(valid, pos, 0)
    return block_table.gather(1, p // block_size) * block_size + p % block_size, valid


def _attended(valid: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
    """valid & attend, attend padded with False (or cut) to valid's length."""
    if attend is None:
        return valid
    length = valid.shape[1]
    cut = attend[:, :length].bool()
    return valid & torch.nn.functional.pad(cut, (0, length - cut.shape[1]), value=False)


def mla_decode_reference(q: torch.Tensor, cache: torch.Tensor, scale_rows: torch.Tensor | None,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, latent: int, softmax_scale: float,
                         attend: torch.Tensor | None = None, *, block_size: int) -> torch.Tensor:
    """o_c [R, H, latent] in q.dtype: gather the context (``PagedPool.read``), then attend in float32."""
    seq_lens = torch.as_tensor(seq_lens, device=q.device)
    length = int(seq_lens.max()) if seq_lens.numel() else 0
    if length == 0:
        return q.new_zeros(q.shape[0], q.shape[1], latent)
    slots, valid = _positions(block_table, seq_lens, block_size, length)
    ctx = PagedPool(cache, scale_rows, torch.float32).read(slots).float().masked_fill(~valid[..., None], 0)
    mask = _attended(valid, attend)
    scores = torch.matmul(q.float(), ctx.transpose(1, 2)) * softmax_scale
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(~mask.any(dim=1)[:, None, None], 0)  # nothing attended: zeros, not NaN
    return torch.matmul(probs, ctx[..., :latent]).to(q.dtype)


# --------------------------------------------------------------------------------------------------- kernel

if HAS_TRITON:

    @triton.jit
    def _load_q(q_ptr, r, heads, hmask, num_heads, latent, rope,
                BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr):
        """The latent [BLOCK_H, BLOCK_L] and rope [BLOCK_H, BLOCK_R] tiles of the query (zeros where padded)."""
        base = q_ptr + (r * num_heads + heads)[:, None] * (latent + rope)
        dl, dr = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
        q_lat = tl.load(base + dl[None, :], mask=hmask[:, None] & (dl < latent)[None, :], other=0.0)
        q_rope = tl.load(base + latent + dr[None, :], mask=hmask[:, None] & (dr < rope)[None, :], other=0.0)
        if FP32_DOT:
            q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
        return q_lat, q_rope

    @triton.jit
    def _attends(r, pos, ok, attend_ptr, attend_stride, attend_len, HAS_ATTEND: tl.constexpr):
        """ok narrowed to the positions of the request's `attend` row (positions past its length: none)."""
        if HAS_ATTEND:
            inside = ok & (pos < attend_len)
            sel = tl.load(attend_ptr + r * attend_stride + pos, mask=inside, other=0)
            ok = inside & (sel != 0)
        return ok

    @triton.jit
    def _rows(bt_ptr, r, bt_stride, pos, ok, PAGE: tl.constexpr):
        """Flat pool rows (int64) of positions `pos` through the block table; masked positions give row 0."""
        block = tl.load(bt_ptr + r * bt_stride + pos // PAGE, mask=ok, other=0).to(tl.int64)
        return block * PAGE + pos % PAGE

    @triton.jit
    def _load_k(cache_ptr, scale_ptr, rows, ok, row_stride, latent, rope,
                HAS_SCALE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
        """Raw (stored dtype) latent [BLOCK_N, BLOCK_L] and rope [BLOCK_N, BLOCK_R] tiles, and the row scales."""
        base = cache_ptr + rows[:, None] * row_stride
        dl, dr = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
        k_lat = tl.load(base + dl[None, :], mask=ok[:, None] & (dl < latent)[None, :], other=0.0)
        k_rope = tl.load(base + latent + dr[None, :], mask=ok[:, None] & (dr < rope)[None, :], other=0.0)
        if HAS_SCALE:
            kscale = tl.load(scale_ptr + rows, mask=ok, other=0.0)
        else:
            kscale = ok.to(tl.float32)  # 1 (masked keys get p = 0 whatever their scale)
        return k_lat, k_rope, kscale

    @triton.jit
    def _online_update(q_lat, q_rope, k_lat, k_rope, kscale, ok, m, den, acc, qk_scale):
        """Fold one block of keys into the running base-2 max m, denominator den and accumulator acc."""
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee")
        s = tl.where(ok[None, :], s * (kscale * qk_scale)[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        pv = tl.dot((p * kscale[None, :]).to(k_lat.dtype), k_lat, input_precision="ieee")
        return m_new, den, acc * alpha[:, None] + pv

    @triton.jit
    def _store(out_ptr, lse_ptr, r, heads, hmask, split, num_splits, num_heads, latent, m, den, acc,
               SPLIT: tl.constexpr, BLOCK_L: tl.constexpr):
        """acc / den (zeros where nothing was attended: den is then 0, else >= 1); with SPLIT also the lse."""
        dl = tl.arange(0, BLOCK_L)
        out = acc / tl.maximum(den, 1.0)[:, None]
        smask = hmask[:, None] & (dl < latent)[None, :]
        if SPLIT:
            part = (r * num_heads + heads) * num_splits + split
            tl.store(out_ptr + part[:, None] * latent + dl[None, :], out, mask=smask)
            lse = tl.where(den > 0, m + tl.log2(tl.maximum(den, 1.0)), float("-inf"))
            tl.store(lse_ptr + part, lse, mask=hmask)
        else:
            offs = (r * num_heads + heads)[:, None] * latent + dl[None, :]
            tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=smask)

    @triton.jit
    def _mla_decode_kernel(
        q_ptr, cache_ptr, scale_ptr, bt_ptr, lens_ptr, attend_ptr, out_ptr, lse_ptr,
        num_heads, latent, rope, row_stride, bt_stride, attend_stride, attend_len, max_ctx, split_len, qk_scale,
        PAGE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_ATTEND: tl.constexpr, SPLIT: tl.constexpr,
        FP32_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        r, split = tl.program_id(0), tl.program_id(2)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        q_lat, q_rope = _load_q(q_ptr, r, heads, hmask, num_heads, latent, rope, BLOCK_L, BLOCK_R, FP32_DOT)
        lo = split * split_len
        hi = tl.minimum(tl.minimum(lo + split_len, tl.load(lens_ptr + r)), max_ctx)
        m = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a fully masked block leaves alpha = 1, p = 0
        den = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = _attends(r, pos, pos < hi, attend_ptr, attend_stride, attend_len, HAS_ATTEND)
            rows = _rows(bt_ptr, r, bt_stride, pos, ok, PAGE)
            k_lat, k_rope, kscale = _load_k(cache_ptr, scale_ptr, rows, ok, row_stride, latent, rope,
                                            HAS_SCALE, BLOCK_L, BLOCK_R)
            m, den, acc = _online_update(q_lat, q_rope, k_lat.to(q_lat.dtype), k_rope.to(q_lat.dtype), kscale, ok,
                                         m, den, acc, qk_scale)
        _store(out_ptr, lse_ptr, r, heads, hmask, split, tl.num_programs(2), num_heads, latent, m, den, acc,
               SPLIT, BLOCK_L)

    @triton.jit
    def _mla_merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, latent,
                          BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
        """One (request, head) and BLOCK_L latent columns: the splits' partials weighted by exp2(lse - max lse)."""
        row = tl.program_id(0)
        s, dl = tl.arange(0, BLOCK_S), tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        lse = tl.load(lse_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
        top = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all empty: every weight 0
        offs = (row * num_splits + s)[:, None] * latent + dl[None, :]
        part = tl.load(part_ptr + offs, mask=(s < num_splits)[:, None] & (dl < latent)[None, :], other=0.0)
        out = tl.sum(part * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1.0)  # the top weight is 1
        tl.store(out_ptr + row * latent + dl, out.to(out_ptr.dtype.element_ty), mask=dl < latent)


# ------------------------------------------------------------------------------------------------- launcher


def _check(q: torch.Tensor, cache: torch.Tensor, scale_rows: torch.Tensor | None, block_table: torch.Tensor,
           latent: int) -> None:
    if q.dim() != 3 or cache.dim() != 2 or q.shape[2] != cache.shape[1] or not 0 < latent <= q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / cache {tuple(cache.shape)} / latent {latent} do not fit")
    if cache.stride(1) != 1:
        raise ValueError("cache rows must be contiguous in their last dimension")
    if scale_rows is not None and (scale_rows.dtype != torch.float32 or scale_rows.shape != (cache.shape[0], 1)
                                   or scale_rows.stride(0) != 1):
        raise ValueError(f"scale_rows must be contiguous float32 [{cache.shape[0]}, 1]")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table {tuple(block_table.shape)} does not match {q.shape[0]} requests")


def default_splits(q: torch.Tensor, programs: int, max_ctx: int) -> int:
    """Context splits so that about two programs run per SM, each split covering >= MIN_SPLIT_POSITIONS."""
    if not q.is_cuda or programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(-(-2 * sms // programs), -(-max_ctx // MIN_SPLIT_POSITIONS), MAX_SPLITS))


def _split_len(max_ctx: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(positions per split, a multiple of block_n; splits actually needed) for a context of max_ctx."""
    per = -(-max(max_ctx, 1) // max(num_splits, 1))
    per = -(-per // block_n) * block_n
    return per, -(-max(max_ctx, 1) // per)


def _merge(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_warps: int) -> None:
    """out [R, H, latent] from the splits' partials [R, H, S, latent] and their lse [R, H, S]."""
    r, h, splits, latent = part.shape
    block_l = min(next_pow2(latent), MERGE_TILE)
    _mla_merge_kernel[(r * h, triton.cdiv(latent, block_l))](part, lse, out, splits, latent,
                                                             BLOCK_S=next_pow2(splits), BLOCK_L=block_l,
                                                             num_warps=num_warps)


@dataclass(frozen=True)
class _Plan:
    """Launch shape: tiles, the context bound max_ctx (block table width * block_size) and its splits."""

    page: int  # block_size
    block_h: int
    block_n: int
    max_ctx: int
    split_len: int
    splits: int


def _plan(q: torch.Tensor, block_table: torch.Tensor, block_size: int, num_splits: int | None, block_h: int,
          block_n: int) -> _Plan:
    block_h, block_n = max(next_pow2(block_h), MIN_TILE), max(next_pow2(block_n), MIN_TILE)
    max_ctx = block_table.shape[1] * block_size
    programs = q.shape[0] * triton.cdiv(q.shape[1], block_h)
    want = num_splits if num_splits is not None else default_splits(q, programs, max_ctx)
    return _Plan(block_size, block_h, block_n, max_ctx, *_split_len(max_ctx, want, block_n))


def _launch(q: torch.Tensor, cache: torch.Tensor, scale_rows: torch.Tensor | None, block_table: torch.Tensor,
            lens: torch.Tensor, attend: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, latent: int,
            softmax_scale: float, plan: _Plan, num_warps: int, num_stages: int) -> None:
    """The main kernel into `out` ([R, H, latent] unsplit, else float32 partials [R, H, S, latent] and lse)."""
    r, h, d = q.shape
    rope = d - latent
    sel = attend.bool().contiguous().view(torch.int8) if attend is not None else lens
    _mla_decode_kernel[(r, triton.cdiv(h, plan.block_h), plan.splits)](
        q.contiguous(), cache, cache if scale_rows is None else scale_rows, block_table, lens, sel, out, lse,
        h, latent, rope, cache.stride(0), block_table.stride(0), sel.stride(0),
        0 if attend is None else sel.shape[1], plan.max_ctx, plan.split_len, softmax_scale * LOG2E,
        PAGE=plan.page, HAS_SCALE=scale_rows is not None, HAS_ATTEND=attend is not None,
        SPLIT=plan.splits > 1, FP32_DOT=q.dtype == torch.float32 or interpreting(),
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, BLOCK_L=max(next_pow2(latent), MIN_TILE),
        BLOCK_R=max(next_pow2(rope), MIN_TILE), num_warps=num_warps, num_stages=num_stages,
    )


def mla_decode(q: torch.Tensor, cache: torch.Tensor, scale_rows: torch.Tensor | None, block_table: torch.Tensor,
               seq_lens: torch.Tensor, latent: int, softmax_scale: float, attend: torch.Tensor | None = None, *,
               block_size: int, num_splits: int | None = None, block_h: int = 16, block_n: int = 32,
               num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """The Triton kernel; same contract as mla_decode_reference. num_splits None: default_splits (1 on CPU)."""
    if not HAS_TRITON:
        raise RuntimeError("mla_decode needs Triton; use mla_decode_reference")
    _check(q, cache, scale_rows, block_table, latent)
    r, h, _ = q.shape
    out = q.new_empty(r, h, latent)
    if out.numel() == 0:
        return out
    plan = _plan(q, block_table, block_size, num_splits, block_h, block_n)
    lens = torch.as_tensor(seq_lens, device=q.device)
    if plan.splits == 1:
        _launch(q, cache, scale_rows, block_table, lens, attend, out, lens, latent, softmax_scale, plan, num_warps,
                num_stages)
        return out
    part = torch.empty(r, h, plan.splits, latent, dtype=torch.float32, device=q.device)
    lse = torch.empty(r, h, plan.splits, dtype=torch.float32, device=q.device)
    _launch(q, cache, scale_rows, block_table, lens, attend, part, lse, latent, softmax_scale, plan, num_warps,
            num_stages)
    _merge(part, lse, out, num_warps)
    return out
