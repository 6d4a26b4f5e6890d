"""Int4 weights kept packed in memory (AWQ / GPTQ checkpoints): a linear layer and the stacked-expert layout.

Storage (one layout for Int4Linear, ParallelExperts.keep_int4 and the Triton kernels): codes two per byte
(`qcodes` uint8 [..., N, K / 2], input 2j in the low nibble of byte j, 2j + 1 in the high one) and per group of
`group` inputs of a row a float16 pair (`qparams` [..., N, K / group, 2]: scale, zero point; zero points 0..15
are exact in float16): w[n, k] = (code - zero) * scale. 0.5 byte a weight + 4 bytes a group (bf16: 2 bytes).

Invariants:
  * off CUDA, forward dequantises the weight to x's dtype and runs F.linear: the output equals the layer loaded
    dequantised, in that dtype, exactly (same values, same GEMM); on CUDA the W4A16 Triton kernel
    (kernels/int4_gemm.py) reads the packed weight, equal to that within float32 accumulation order;
  * buffers keep their dtypes through `.to(dtype)` / `.half()`; only device moves apply to them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import triton_enabled
from deepinfer.layers.quant_linear import _keep_dtype
from deepinfer.quantization.int4 import Int4Weight


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] of codes [..., n] (0..15): code 2j in the low nibble of byte j, 2j + 1 in the high one."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


def group_params(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float16 [..., G, 2] (scale, zero) of float16-valued scales and integer zeros [..., G]."""
    return torch.stack([scales.to(torch.float16), zeros.to(torch.float16)], -1).contiguous()


def dequantize_packed(packed: torch.Tensor, params: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K] in `dtype` of packed codes [..., N, K / 2] with (scale, zero) params [..., N, K / group, 2]:
    computed in float32 and rounded once, so it equals the loader's float32 dequantisation cast to `dtype`."""
    codes = unpack_nibbles(packed)
    shape = codes.shape
    tiles = codes.view(*shape[:-1], shape[-1] // group, group).float()
    p = params.float()
    return ((tiles - p[..., 1:]) * p[..., :1]).view(shape).to(dtype)


class Int4Linear(nn.Module):
    """y = x @ W^T with W kept as packed int4 codes and float16 (scale, zero) pairs per group."""

    def __init__(self, weight: Int4Weight, device: torch.device | str | None = None):
        super().__init__()
        out, cols = weight.codes.shape
        self.in_features, self.out_features, self.group = cols, out, weight.group
        self.register_buffer("qcodes", pack_nibbles(weight.codes).to(device))
        self.register_buffer("qparams", group_params(weight.scales, weight.zeros).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_enabled(x):
            from deepinfer.kernels.int4_gemm import int4_linear

            return int4_linear(x, self.qcodes, self.qparams, self.group)
        return F.linear(x, self.dequantized_weight(x.dtype))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_packed(self.qcodes, self.qparams, self.group, dtype)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qcodes, self.qparams))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Int4Linear:
        return super()._apply(lambda t: _keep_dtype(fn, t), recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"
