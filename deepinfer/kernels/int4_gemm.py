"""Packed int4 weight GEMM (W4A16, AWQ / GPTQ groups): y = x @ dequant(W).T, the weight staying packed in memory.

Layout (layers/int4_linear.py): codes uint8 [N, K / 2] (input 2j in the low nibble of byte j), params float16
[N, K / group, 2] (scale, zero point per group of `group` inputs of a row); w[n, k] = (code - zero) * scale.

Invariants of the kernel:
  * each program dequantises only its [BLOCK_K, BLOCK_N] weight tile, in float32: codes and zero points are
    small integers, so (code - zero) is exact and one rounding (times the float16 scale) gives the value the
    torch reference computes; the tile is then cast to the dot's input type;
  * BLOCK_K divides `group`, so a tile's K range lies in one group: one (scale, zero) per output column a tile;
  * the dot runs in float32 ("ieee") for float32 activations and under the interpreter, otherwise in x's
    16-bit type, accumulating in float32; masked loads read zeros past M, N and K.

`int4_linear_reference` is the torch definition the kernel is tested against: dequantise to float32, then
F.linear in float32, cast to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import HAS_TRITON, interpreting, next_pow2
from deepinfer.kernels.fp8_gemm import MAX_TILE_K, MAX_TILE_M, MAX_TILE_N, MIN_TILE, tile_for

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _int4_gemm_kernel(x_ptr, q_ptr, p_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_qn, stride_qk,
                          stride_pn, stride_pg, stride_ym, stride_yn, GROUP: tl.constexpr, FP32_DOT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + kb[None, :] * stride_qk,
                             mask=n_ok[:, None] & (2 * kb[None, :] < K), other=0)
            codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            params = p_ptr + offs_n * stride_pn + (k0 // GROUP) * stride_pg
            scale = tl.load(params, mask=n_ok, other=0.0).to(tl.float32)
            zero = tl.load(params + 1, mask=n_ok, other=0.0).to(tl.float32)
            w = tl.trans((codes - zero[:, None]) * scale[:, None])  # [BLOCK_K, BLOCK_N] = W^T
            if FP32_DOT:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def int4_linear_reference(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, group: int) -> torch.Tensor:
    from deepinfer.layers.int4_linear import dequantize_packed

    return F.linear(x.float(), dequantize_packed(codes, params, group, torch.float32)).to(x.dtype)


def _check_operands(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, group: int) -> None:
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be 2-D uint8 [N, K / 2], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the packed weight holds {k}")
    if k % group or tuple(params.shape) != (n, k // group, 2):
        raise ValueError(f"params shape {tuple(params.shape)} does not match [{n}, {k} / {group}, 2]")


def int4_linear(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, group: int) -> torch.Tensor:
    """y [..., N] in x.dtype = x [..., K] @ dequant(codes, params).T, via the Triton kernel (needs Triton and,
    outside the interpreter, CUDA tensors)."""
    if not HAS_TRITON:
        raise RuntimeError("int4_linear needs Triton; use int4_linear_reference")
    _check_operands(x, codes, params, group)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], codes.shape[0], dtype=x.dtype, device=x.device)
    if y.numel():
        _launch(x2, codes, params.contiguous(), y, group)
    return y.view(*x.shape[:-1], codes.shape[0])


def _launch(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, y: torch.Tensor, group: int) -> None:
    (m, k), n = x.shape, codes.shape[0]
    block_m = min(MAX_TILE_M, max(MIN_TILE, next_pow2(m)))
    block_n = min(MAX_TILE_N, max(MIN_TILE, next_pow2(n)))
    block_k = tile_for(group, MAX_TILE_K)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, codes, params, y, m, n, k, *x.stride(), *codes.stride(), params.stride(0),
                            params.stride(1), *y.stride(), GROUP=group,
                            FP32_DOT=x.dtype == torch.float32 or interpreting(), BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k)
