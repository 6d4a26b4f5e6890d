"""Test-only quantisers producing the checkpoint formats deepinfer's loader dequantises.

FP8: float8_e4m3fn weight + per-block scale (float32 `weight_scale_inv` = amax / 448, or UE8M0 power of two).
FP4: E2M1 codes packed two per byte, input 2i in the low nibble, + UE8M0 scale per 32 inputs of a row.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
# E2M1 code -> value (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(out/bo), ceil(in/bi)] max |w| per block (edge blocks partial)."""
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[: w.shape[0], : w.shape[1]] = w.abs()
    return padded.view(rows, block[0], cols, block[1]).amax(dim=(1, 3))


def expand_blocks(grid: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Per-block values broadcast to every element of a `shape` tensor."""
    full = grid.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def quantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 codes of w / scale (scale per block, so |w / scale| <= 448 when scale >= amax / 448)."""
    x = w / expand_blocks(scale.float(), w.shape, block)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_scale_inv(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3 style float32 `weight_scale_inv`: amax / 448 (1 for an all-zero block)."""
    amax = block_amax(w, block)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales 2^e: byte e + 127 viewed as float8_e8m0fnu."""
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_scale_ue8m0(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V4 style power-of-two scale 2^ceil(log2(amax / 448)) >= amax / 448, as float8_e8m0fnu."""
    amax = block_amax(w, block).clamp_min(1e-30)
    return e8m0(torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] E2M1 codes (0..15) -> int8 [out, in/2]; input 2i in the low nibble, 2i+1 in the high one."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
