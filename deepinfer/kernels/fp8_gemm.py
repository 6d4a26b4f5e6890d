"""Block-scaled FP8 weight GEMM (W8A16): y = x @ dequant(weight).T (+ bias), the weight staying FP8 in memory.

Layout (DeepSeek checkpoints): `weight` float8 [N, K]; `scale` [ceil(N/bn), ceil(K/bk)], scale[i, j] the dequant
factor ("weight_scale_inv") of rows [i*bn, (i+1)*bn) x cols [j*bk, (j+1)*bk); (128, 128) for V3/V4, (32, 32) with
power-of-two UE8M0 (`float8_e8m0fnu`) scales for V4.1. Edge blocks of a shape that is not a multiple of the block
are partial.

Invariants of the kernel:
  * activations are not quantised: the weight tile is converted exactly to the dot's input type (every E4M3 /
    E5M2 value is exact in bf16, fp16 and fp32), its product with the x tile is accumulated in float32 and then
    scaled by the tile's one scale -- BLOCK_N | bn and BLOCK_K | bk, so a (BLOCK_N, BLOCK_K) tile never straddles
    two scale blocks;
  * the dot runs in float32 ("ieee", no tf32) for float32 activations and under the interpreter (its bf16
    `tl.dot` is not exact); otherwise in x's 16-bit type;
  * masked loads read zeros past M, N and K, so ragged M and partial edge blocks need no padding;
  * the output has x's dtype and shape [..., N]; the bias is added in float32 before the final cast.

`fp8_block_linear_reference` is the torch definition the kernel is tested against: the loader's
`dequantize_fp8_block` to float32, then F.linear in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import HAS_TRITON, interpreting, next_pow2
from deepinfer.models.loader import dequantize_fp8_block, scale_to_float

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MIN_TILE = 16  # tl.dot needs every tile dimension >= 16
MAX_TILE_N, MAX_TILE_K, MAX_TILE_M = 64, 128, 64

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_block_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                               stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
                               stride_ym, stride_yn,
                               QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                               FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        s_row = s_ptr + ((pid_n * BLOCK_N) // QUANT_N) * stride_sn  # the tile's one scale row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N] = W^T
            scale = tl.load(s_row + (k0 // QUANT_K) * stride_sk)
            if FP32_DOT:
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, w.to(x.dtype))
            acc += part * scale
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Shape [ceil(N/bn), ceil(K/bk)] of the scale tensor of an [N, K] weight with (bn, bk) blocks."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch definition of `fp8_block_linear`: dequantise to float32, F.linear in float32, cast to x's dtype."""
    w = dequantize_fp8_block(weight, scale, tuple(block))
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def tile_for(quant_block: int, cap: int) -> int:
    """Largest power of two dividing `quant_block`, at most `cap`; ValueError below the tl.dot minimum."""
    tile = min(quant_block & -quant_block, cap)
    if tile < MIN_TILE:
        raise ValueError(f"quantisation block {quant_block} has no power-of-two divisor >= {MIN_TILE}")
    return tile


def _check_operands(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or weight.dtype not in FP8_WEIGHT_DTYPES:
        raise ValueError(f"weight must be a 2-D fp8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if tuple(scale.shape) != scale_grid(tuple(weight.shape), block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} with "
                         f"{block[0]}x{block[1]} blocks (expected {scale_grid(tuple(weight.shape), block)})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match {weight.shape[0]} outputs")


def _launch_config(m: int, block: tuple[int, int]) -> dict[str, int]:
    """Tile sizes: BLOCK_M 16 for decode-sized M, up to 64 for prefill; BLOCK_N/BLOCK_K divide the quant block."""
    return {"BLOCK_M": min(MAX_TILE_M, max(MIN_TILE, next_pow2(m))),
            "BLOCK_N": tile_for(block[0], MAX_TILE_N), "BLOCK_K": tile_for(block[1], MAX_TILE_K)}


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] in x.dtype = x [..., K] @ (weight * block scale).T (+ bias), via the Triton kernel.

    `scale` may be float32 or UE8M0 (`float8_e8m0fnu`, converted here); it is not checked for non-finite
    entries (the reference is). Needs Triton and, outside the interpreter, CUDA tensors.
    """
    if not HAS_TRITON:
        raise RuntimeError("fp8_block_linear needs Triton; use fp8_block_linear_reference")
    block = (int(block[0]), int(block[1]))
    _check_operands(x, weight, scale, block, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if y.numel():
        _launch(x2, weight, scale_to_float(scale), bias, y, block)
    return y.view(*x.shape[:-1], weight.shape[0])


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            y: torch.Tensor, block: tuple[int, int]) -> None:
    (m, k), n = x.shape, weight.shape[0]
    cfg = _launch_config(m, block)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_block_gemm_kernel[grid](
        x, weight, scale, y if bias is None else bias.contiguous(), y, m, n, k,
        *x.stride(), *weight.stride(), *scale.stride(), *y.stride(),
        QUANT_N=block[0], QUANT_K=block[1], HAS_BIAS=bias is not None,
        FP32_DOT=x.dtype == torch.float32 or interpreting(), **cfg)
