"""Fused routed MoE for DeepSeek models: out[t] = sum_k w[t, k] * w2[e] @ swiglu(w13[e] @ x[t]), e = ids[t, k].

Weights (E experts, hidden D, expert intermediate I): w13 [E, 2I, D] holds the gate rows [0, I) then the up rows
[I, 2I); w2 is [E, D, I]. `quant` picks how they are stored:
  * None: a float dtype (bf16 / fp16 / fp32), used as is;
  * "fp8": float8 E4M3 (or E5M2) with block scales [E, ceil(N/bn), ceil(K/bk)] for an [N, K] matrix and
    `block` = (bn, bk) -- (128, 128) for V3/V4, (32, 32) with UE8M0 (`float8_e8m0fnu`) scales for V4.1;
    w = q * scale, edge blocks partial (the loader's `dequantize_fp8_block`);
  * "mxfp4": E2M1 codes two per byte along K ([E, N, K/2] uint8 / int8 / float4_e2m1fn_x2; input 2i is the low
    nibble of byte i) with one scale per 32 inputs of a row ([E, N, ceil(K/32)], UE8M0 or float); the loader's
    `dequantize_fp4`. `block` is ignored;
  * "int4": AWQ / GPTQ codes two per byte along K ([E, N, K/2] uint8, low nibble first) with float16 (scale,
    zero) pairs per group of `block[1]` inputs of a row ([E, N, K/group, 2]): w = (code - zero) * scale
    (layers/int4_linear.py).

Pipeline (no host synchronisation; every shape depends only on T, K, E and the tiles):
  1. `moe_align` sorts the T*K (token, k) slots by expert (stable) and pads each expert's run to a multiple of
     BLOCK_M with the sentinel T*K, so every M-tile belongs to one expert; `expert_of_block` is -1 for the
     unused tail tiles of the static capacity, whose programs exit at once.
  2. kernel A (grid M-tiles x I-tiles): gathers the token rows x[slot // K] itself, accumulates gate and up
     tiles of one expert together in float32 and writes h = silu(min(g, L)) * clamp(u, -L, L) (no clamp when
     limit <= 0) in x's dtype, h [P, I] in sorted order (sentinel rows are zeros).
  3. kernel B (grid M-tiles x D-tiles): h @ w2[e]^T in float32, times the routing weight, stored to row
     `slot` of a float32 [T*K, D] buffer: each row has one writer (no atomics, deterministic); the sum over
     k then runs in torch, in float32, and is cast to x's dtype.

Invariants of both kernels:
  * weights stay quantised in memory; each program dequantises only its [BLOCK_K, BLOCK_N] tile: FP8 tiles are
    converted exactly to the dot's input type and their product scaled per output column by the scale of its
    (n-block, k-block) -- BLOCK_K divides bk, so a tile's K range never straddles two scale blocks; MXFP4
    tiles are unpacked, decoded and multiplied by their per-32 scales before the dot (Hopper has no FP4 dot);
    int4 tiles are unpacked and dequantised as (code - zero) * scale in float32 before the dot;
  * UE8M0 scales are read as bytes and decoded to 2^(b-127) in the kernel; other scales are float32;
  * the dot runs in float32 ("ieee") for float32 activations and under the interpreter (its bf16 `tl.dot` is
    not exact), otherwise in x's 16-bit type, always accumulating in float32;
  * masked loads read zeros past D, I, the expert rows and sentinel slots, so no shape needs padding.

`fused_moe_reference` is the torch definition the kernels are tested against: the loader's dequantisation
of every expert to float32, then `layers.moe.routed_experts` in float32. Callers dispatch with
`deepinfer.kernels.triton_enabled`; `fused_moe` itself always runs the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels import HAS_TRITON, interpreting, next_pow2
from deepinfer.layers.moe import routed_experts
from deepinfer.models.loader import FP4_GROUP, dequantize_fp4, dequantize_fp8_block

QUANT_MODES = {None: 0, "fp8": 1, "mxfp4": 2, "int4": 3}
FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_WEIGHT_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
MIN_TILE = 16  # tl.dot needs every tile dimension >= 16

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_value(s, SCALE_E8M0: tl.constexpr):
        """float32 factor of a loaded scale: UE8M0 byte b -> 2^(b-127) (b = 0 is the subnormal 2^-127)."""
        if SCALE_E8M0:
            b = s.to(tl.int32)
            value = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
        else:
            value = s.to(tl.float32)
        return value

    @triton.jit
    def _e2m1(code):
        """float32 value of 4-bit E2M1 codes: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
        c = code.to(tl.int32)
        e = (c >> 1) & 3
        m = (c & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1 << e).to(tl.float32) * (0.5 + 0.25 * m))
        return tl.where(c >= 8, -mag, mag)

    @triton.jit
    def _weight_tile(w_rows, s_rows, row_mask, k0, K, stride_wk, stride_sk, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_K, BLOCK_N] tile W[rows, k0:k0+BLOCK_K]^T; MXFP4 comes decoded and scaled, FP8 unscaled."""
        ks = k0 + tl.arange(0, BLOCK_K)
        if QUANT == 2:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            codes = tl.load(w_rows[:, None] + kb[None, :] * stride_wk,
                            mask=row_mask[:, None] & (2 * kb[None, :] < K), other=0)
            s = tl.load(s_rows[:, None] + (ks[None, :] // GROUP) * stride_sk,
                        mask=row_mask[:, None] & (ks[None, :] < K), other=0)
            values = tl.interleave(_e2m1(codes & 0xF), _e2m1(codes >> 4))  # [BLOCK_N, BLOCK_K], k = 2i + nibble
            w = tl.trans(values * _scale_value(s, SCALE_E8M0))
        elif QUANT == 3:  # int4: (scale, zero) pairs, the scale row flattened to [2 G]
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            codes = tl.load(w_rows[:, None] + kb[None, :] * stride_wk,
                            mask=row_mask[:, None] & (2 * kb[None, :] < K), other=0)
            ok = row_mask[:, None] & (ks[None, :] < K)
            pair = s_rows[:, None] + (2 * (ks[None, :] // GROUP)) * stride_sk
            scale = tl.load(pair, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(pair + stride_sk, mask=ok, other=0.0).to(tl.float32)
            values = tl.interleave(codes & 0xF, codes >> 4).to(tl.float32)
            w = tl.trans((values - zero) * scale)
        else:
            w = tl.load(w_rows[None, :] + ks[:, None] * stride_wk,
                        mask=row_mask[None, :] & (ks[:, None] < K), other=0.0)
        return w

    @triton.jit
    def _accumulate(acc, x, w_rows, s_rows, row_mask, k0, K, stride_wk, stride_sk, QUANT: tl.constexpr,
                    QUANT_K: tl.constexpr, GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, FP32_DOT: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """acc + x @ dequant(W[rows, k0:k0+BLOCK_K])^T for one K step, in float32."""
        w = _weight_tile(w_rows, s_rows, row_mask, k0, K, stride_wk, stride_sk, QUANT, GROUP, SCALE_E8M0, BLOCK_K)
        if FP32_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        if QUANT == 1:  # FP8: the (n-block, k-block) scale of each output column
            s = tl.load(s_rows + (k0 // QUANT_K) * stride_sk, mask=row_mask, other=0)
            part = part * _scale_value(s, SCALE_E8M0)[None, :]
        return acc + part

    @triton.jit
    def _swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _gate_up_kernel(x_ptr, slots_ptr, expert_ptr, w_ptr, s_ptr, h_ptr, num_slots, INTER, D, limit,
                        stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                        stride_hm, stride_hn,
                        TOPK: tl.constexpr, QUANT: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr,
                        GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(expert_ptr + pid_m)
        if expert < 0:  # tail tile of the static capacity
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slots_ptr + offs_m).to(tl.int64)  # slots * stride passes 2^31 at large batches
        offs_m = offs_m.to(tl.int64)
        valid = slots < num_slots
        x_rows = x_ptr + (slots // TOPK) * stride_xm
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < INTER
        w_e, s_e = w_ptr + expert.to(tl.int64) * stride_we, s_ptr + expert.to(tl.int64) * stride_se
        gate_w, up_w = w_e + offs_n * stride_wn, w_e + (offs_n + INTER) * stride_wn
        gate_s, up_s = s_e + (offs_n // QUANT_N) * stride_sn, s_e + ((offs_n + INTER) // QUANT_N) * stride_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows[:, None] + ks[None, :] * stride_xk, mask=valid[:, None] & (ks[None, :] < D), other=0.0)
            acc_g = _accumulate(acc_g, x, gate_w, gate_s, n_ok, k0, D, stride_wk, stride_sk, QUANT, QUANT_K, GROUP,
                                SCALE_E8M0, FP32_DOT, BLOCK_K)
            acc_u = _accumulate(acc_u, x, up_w, up_s, n_ok, k0, D, stride_wk, stride_sk, QUANT, QUANT_K, GROUP,
                                SCALE_E8M0, FP32_DOT, BLOCK_K)
        h = _swiglu(acc_g, acc_u, limit, HAS_LIMIT)
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :] * stride_hn, h.to(h_ptr.dtype.element_ty),
                 mask=n_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, slots_ptr, expert_ptr, route_ptr, w_ptr, s_ptr, y_ptr, num_slots, D, INTER,
                     stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                     stride_ym, stride_yn,
                     QUANT: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, GROUP: tl.constexpr,
                     SCALE_E8M0: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slots_ptr + offs_m).to(tl.int64)  # slots * stride passes 2^31 at large batches
        offs_m = offs_m.to(tl.int64)
        valid = slots < num_slots
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // QUANT_N) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + offs_m[:, None] * stride_hm + ks[None, :] * stride_hk, mask=ks[None, :] < INTER,
                        other=0.0)
            acc = _accumulate(acc, h, w_rows, s_rows, n_ok, k0, INTER, stride_wk, stride_sk, QUANT, QUANT_K, GROUP,
                              SCALE_E8M0, FP32_DOT, BLOCK_K)
        route = tl.load(route_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        tl.store(y_ptr + slots[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc * route[:, None],
                 mask=valid[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class MoeTiles:
    """Upper bounds of the tile sizes (powers of two, >= 16); `fused_moe` shrinks them to the shapes and to
    the FP8 quantisation block. block_m is the expert padding of `moe_align` too."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_TILE or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_TILE}, got {value}")


def default_tiles(num_slots: int, num_experts: int) -> MoeTiles:
    """H200 defaults: BLOCK_M follows the mean (token, k) slots per expert (16 for decode, 64 for prefill)."""
    mean = -(-num_slots // max(num_experts, 1))
    block_m = min(64, max(MIN_TILE, next_pow2(mean)))
    return MoeTiles(block_m=block_m, num_warps=4 if block_m <= 32 else 8)


def _fit(tile: int, dim: int, divide: int = 0) -> int:
    """`tile` shrunk to the smallest power of two >= dim (small shapes) and, when given, to divide `divide`."""
    fitted = min(tile, max(MIN_TILE, next_pow2(dim)))
    if divide:
        fitted = min(fitted, divide & -divide)
    if fitted < MIN_TILE:
        raise ValueError(f"quantisation block {divide} has no power-of-two divisor >= {MIN_TILE}")
    return fitted


# ------------------------------------------------------------------------------------------------ alignment


def padded_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Static upper bound of sum_e ceil(count_e / block_m) * block_m over any routing of num_slots slots."""
    bound = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_slots [P] int32, expert_of_block [P / block_m] int32, num_valid 0-dim int64).

    Slot s = t * K + k. Slots are sorted by expert, stable; expert e's run starts at a multiple of block_m and
    is padded to one with the sentinel T*K. num_valid is the padded length in use; tiles past it have
    expert -1. P = padded_capacity(T*K, E, block_m) depends only on the shapes (no host synchronisation).
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    capacity = padded_capacity(n, num_experts, block_m)
    slots = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    slots[(ends - padded)[sorted_ids] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    experts = torch.searchsorted(ends, block_starts, right=True)
    return slots, torch.where(experts < num_experts, experts, -1).to(torch.int32), ends[-1]


# ------------------------------------------------------------------------------------------------ reference


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, quant: str | None,
                       block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float32 [E, N, K] of stacked expert weights, through the loader's dequantisation (whole experts)."""
    if quant is None:
        return w.float()
    if quant == "fp8":
        return torch.stack([dequantize_fp8_block(w[e], scale[e], tuple(block)) for e in range(w.shape[0])])
    if quant == "int4":
        from deepinfer.layers.int4_linear import dequantize_packed

        return dequantize_packed(w, scale, block[1], torch.float32)
    return torch.stack([dequantize_fp4(w[e], scale[e]) for e in range(w.shape[0])])


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, limit: float = 0.0, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, quant: str | None = None,
                        block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Torch definition of `fused_moe`: dequantised float32 experts, `routed_experts` in float32, x's dtype."""
    _check_operands(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, quant, block)
    w13f, w2f = dequantize_experts(w13, w13_scale, quant, block), dequantize_experts(w2, w2_scale, quant, block)
    return routed_experts(x.float(), topk_ids, topk_weights.float(), w13f, w2f, limit).to(x.dtype)


# ------------------------------------------------------------------------------------------------ checks


def _logical_shape(w: torch.Tensor, quant: str | None) -> tuple[int, int, int]:
    """[E, N, K] of the values a stored weight stands for (MXFP4 packs two values per byte along K)."""
    if w.dim() != 3:
        raise ValueError(f"expert weights must be 3-D [E, N, K], got {tuple(w.shape)}")
    e, n, k = w.shape
    return (e, n, 2 * k) if quant in ("mxfp4", "int4") else (e, n, k)


def _scale_shape(shape: tuple[int, int, int], quant: str | None, block: tuple[int, int]) -> tuple[int, ...] | None:
    e, n, k = shape
    if quant == "fp8":
        return e, -(-n // block[0]), -(-k // block[1])
    if quant == "int4":
        return e, n, k // block[1], 2
    return (e, n, -(-k // FP4_GROUP)) if quant == "mxfp4" else None


def _check_weight(name: str, w: torch.Tensor, scale: torch.Tensor | None, quant: str | None,
                  block: tuple[int, int], shape: tuple[int, int, int]) -> None:
    allowed = {None: (torch.float32, torch.bfloat16, torch.float16), "fp8": FP8_WEIGHT_DTYPES,
               "mxfp4": FP4_WEIGHT_DTYPES, "int4": (torch.uint8,)}[quant]
    if w.dtype not in allowed:
        raise ValueError(f"{name}: dtype {w.dtype} does not fit quant={quant!r}")
    if _logical_shape(w, quant) != shape:
        raise ValueError(f"{name}: shape {tuple(w.shape)} holds {_logical_shape(w, quant)}, expected {shape}")
    want = _scale_shape(shape, quant, block)
    got = None if scale is None else tuple(scale.shape)
    if got != want:
        raise ValueError(f"{name}_scale: shape {got} does not match quant={quant!r} block={block} (expected {want})")


def _check_operands(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                    quant: str | None, block: tuple[int, int]) -> int:
    """Validates shapes and dtypes; returns the expert intermediate size I."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {list(QUANT_MODES)}, got {quant!r}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != len(x):
        raise ValueError(f"need x [T, D], topk ids/weights [T, K]; got {tuple(x.shape)}, {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    e, two_i, d = _logical_shape(w13, quant)
    if two_i % 2 or d != x.shape[1]:
        raise ValueError(f"w13 holds {(e, two_i, d)}, expected [E, 2I, {x.shape[1]}]")
    if quant == "int4" and (d % block[1] or (two_i // 2) % block[1]):
        raise ValueError(f"int4 experts: hidden {d} and intermediate {two_i // 2} must be multiples of the group "
                         f"{block[1]}")
    _check_weight("w13", w13, w13_scale, quant, block, (e, two_i, d))
    _check_weight("w2", w2, w2_scale, quant, block, (e, d, two_i // 2))
    return two_i // 2


# ------------------------------------------------------------------------------------------------ launch


@dataclass(frozen=True)
class _KernelWeight:
    """A stored expert weight as the kernels read it: data, scale (the data itself when unquantised), their
    strides and the quantisation constexprs."""

    data: torch.Tensor
    scale: torch.Tensor
    meta: dict

    @property
    def strides(self) -> tuple[int, ...]:
        return (*self.data.stride(), *self.scale.stride())


def _kernel_scale(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor the kernel reads, whether it holds UE8M0 bytes); non-UE8M0 scales become float32 (small)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), True
    return scale.float(), False


def _kernel_weight(w: torch.Tensor, scale: torch.Tensor | None, quant: str | None,
                   block: tuple[int, int]) -> _KernelWeight:
    meta = {"QUANT": QUANT_MODES[quant], "QUANT_N": 1, "QUANT_K": 1, "GROUP": FP4_GROUP, "SCALE_E8M0": False}
    if quant is None:
        return _KernelWeight(w, w, meta)
    if quant == "int4":  # (scale, zero) pairs read from each row's flattened [2 G] params
        meta.update(QUANT=QUANT_MODES["int4"], GROUP=block[1])
        return _KernelWeight(w, scale.contiguous().flatten(-2), meta)
    kscale, meta["SCALE_E8M0"] = _kernel_scale(scale)
    if quant == "fp8":
        meta["QUANT_N"], meta["QUANT_K"] = block
        return _KernelWeight(w, kscale, meta)
    return _KernelWeight(w.view(torch.uint8), kscale, meta)


def _k_divisor(quant: str | None, block: tuple[int, int]) -> int:
    """What BLOCK_K must divide: the FP8 block's K extent (a tile's product has one scale per column)."""
    return block[1] if quant == "fp8" else 0


def _gate_up(x: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor, topk: int, w: _KernelWeight,
             inter: int, limit: float, tiles: MoeTiles, k_divisor: int) -> torch.Tensor:
    h = torch.empty(slots.numel(), inter, dtype=x.dtype, device=x.device)
    block_n, block_k = _fit(tiles.block_n, inter), _fit(tiles.block_k, x.shape[1], k_divisor)
    grid = (experts.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, slots, experts, w.data, w.scale, h, topk * len(x), inter, x.shape[1], float(limit),
        *x.stride(), *w.strides, *h.stride(), TOPK=topk, HAS_LIMIT=limit > 0,
        FP32_DOT=x.dtype == torch.float32 or interpreting(), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **w.meta)
    return h


def _down(h: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor, route: torch.Tensor, w: _KernelWeight,
          hidden: int, tiles: MoeTiles, k_divisor: int) -> torch.Tensor:
    rows = torch.empty(route.numel(), hidden, dtype=torch.float32, device=h.device)
    block_n, block_k = _fit(tiles.block_n, hidden), _fit(tiles.block_k, h.shape[1], k_divisor)
    grid = (experts.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](
        h, slots, experts, route, w.data, w.scale, rows, route.numel(), hidden, h.shape[1],
        *h.stride(), *w.strides, *rows.stride(), FP32_DOT=h.dtype == torch.float32 or interpreting(),
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **w.meta)
    return rows


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, limit: float = 0.0, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, quant: str | None = None, block: tuple[int, int] = (128, 128),
              tiles: MoeTiles | None = None) -> torch.Tensor:
    """[T, D] in x's dtype: the routed experts of x [T, D] for topk ids / weights [T, K], via the two Triton
    kernels; same contract as `fused_moe_reference`. ids must lie in [0, E) (not checked: no host sync).
    Needs Triton and, outside the interpreter, CUDA tensors."""
    if not HAS_TRITON:
        raise RuntimeError("fused_moe needs Triton; use fused_moe_reference")
    block = (int(block[0]), int(block[1]))
    inter = _check_operands(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, quant, block)
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    tiles = tiles or default_tiles(t * k, w13.shape[0])
    slots, experts, _ = moe_align(topk_ids, w13.shape[0], tiles.block_m)
    divisor = _k_divisor(quant, block)
    h = _gate_up(x, slots, experts, k, _kernel_weight(w13, w13_scale, quant, block), inter, limit, tiles, divisor)
    route = topk_weights.reshape(-1).float().contiguous()
    rows = _down(h, slots, experts, route, _kernel_weight(w2, w2_scale, quant, block), x.shape[1], tiles, divisor)
    return rows.view(t, k, -1).sum(1).to(x.dtype)
