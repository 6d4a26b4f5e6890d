"""A linear layer whose weight stays block-quantised FP8 in memory (half of bf16, plus one float32 per block).

Invariants:
  * `weight` is float8 [out_features, in_features] and `weight_scale_inv` float32 [ceil(out/bn), ceil(in/bk)]
    (the checkpoint names: w = weight * weight_scale_inv per (bn, bk) block, edge blocks partial); `bias`, when
    present, is float32 [out_features]. All three are buffers (no grad, in the state dict) and keep their dtypes
    through `.to(dtype)` / `.half()`: only device moves apply to them;
  * forward on CUDA (`triton_enabled`) is the Triton W8A16 GEMM (kernels/fp8_gemm.py); elsewhere it is the torch
    reference, dequantise-then-F.linear in float32, so a CPU forward equals the dequantised layer exactly;
    both return x's dtype;
  * `quantize` picks one scale per block from its absmax (absmax / 448, or with ue8m0 the power of two
    2^ceil(log2(absmax / 448)) as V4.1 stores), so every block value divided by its scale lies within +-448 and
    the E4M3 cast (after a clamp, since fp32 -> fp8 casts do not saturate) only rounds: each dequantised value
    is within half an E4M3 ulp (2^-4 relative, 2^-10 * scale in the subnormal range) of the float weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import triton_enabled
from deepinfer.kernels.fp8_gemm import fp8_block_linear, fp8_block_linear_reference, scale_grid
from deepinfer.layers.mx_quant import FP8_MAX, e4m3, pow2_scale
from deepinfer.models.loader import dequantize_fp8_block, scale_to_float

_FP8_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_AMAX_FLOOR = 1e-12  # an all-zero block gets a tiny positive scale (its codes are all zero)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                       ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]) of a float [N, K] weight, per-block absmax."""
    (n, k), (bn, bk) = weight.shape, block
    gn, gk = scale_grid((n, k), block)
    tiles = F.pad(weight.detach().float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(_AMAX_FLOOR)
    scale = pow2_scale(amax, _FP8_INV.to(amax.device)) if ue8m0 else amax / FP8_MAX
    codes = e4m3(tiles / scale[:, None, :, None]).view(gn * bn, gk * bk)
    return codes[:n, :k].contiguous(), scale


def _keep_dtype(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """`fn(t)` when it keeps t's dtype, else t moved only to fn's device."""
    out = fn(t)
    return out if out.dtype == t.dtype else t.to(out.device)


class FP8BlockLinear(nn.Module):
    """y = x @ (weight * block scales).T (+ bias) with an FP8 weight of (bn, bk) blocks."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = (128, 128), bias: bool = False,
                 device: torch.device | str | None = None, weight_dtype: torch.dtype = torch.float8_e4m3fn):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, (int(block[0]), int(block[1]))
        grid = scale_grid((out_features, in_features), self.block)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(grid, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                       bias: torch.Tensor | None = None) -> FP8BlockLinear:
        """The layer holding a checkpoint's fp8 `weight` and its `weight_scale_inv` (float32 or UE8M0) as given."""
        layer = cls(weight.shape[1], weight.shape[0], block, bias is not None, "meta", weight.dtype)
        if tuple(scale.shape) != tuple(layer.weight_scale_inv.shape):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} with "
                             f"{block[0]}x{block[1]} blocks (expected {tuple(layer.weight_scale_inv.shape)})")
        layer.weight, layer.weight_scale_inv = weight, scale_to_float(scale).to(weight.device)
        layer.bias = None if bias is None else bias.detach().float().to(weight.device)
        return layer

    @classmethod
    def quantize(cls, linear: nn.Linear, block: tuple[int, int] = (128, 128), ue8m0: bool = False) -> FP8BlockLinear:
        """`linear` block-quantised to FP8 (per-block absmax scales; power-of-two ones with ue8m0)."""
        weight, scale = quantize_fp8_block(linear.weight, block, ue8m0)
        return cls.from_quantized(weight, scale, block, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = fp8_block_linear if triton_enabled(x) else fp8_block_linear_reference
        return gemm(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 [out_features, in_features] weight the layer stands for."""
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block)

    def memory_bytes(self) -> int:
        """Bytes of the stored tensors: fp8 weight + float32 scales (+ float32 bias)."""
        tensors = (self.weight, self.weight_scale_inv, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FP8BlockLinear:
        return super()._apply(lambda t: _keep_dtype(fn, t), recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"weight_dtype={self.weight.dtype}, bias={self.bias is not None}")
