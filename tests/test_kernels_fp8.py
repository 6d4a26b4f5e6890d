"""Block-scaled FP8 GEMM kernel (kernels/fp8_gemm.py) against its torch reference under Triton's interpreter on
CPU, and the FP8BlockLinear layer (layers/quant_linear.py): quantisation error, CPU forward, memory.

Activations are float32 here (the interpreter's bf16 tl.dot is not exact), so kernel and reference differ only
in float32 summation order and where the block scale is applied: ~1e-5 relative."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from deepinfer.kernels.fp8_gemm import (  # noqa: E402
    fp8_block_linear,
    fp8_block_linear_reference,
    tile_for,
)
from deepinfer.layers.quant_linear import FP8BlockLinear, quantize_fp8_block  # noqa: E402
from deepinfer.models.loader import dequantize_fp8_block  # noqa: E402

RTOL = 1e-5


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float weight whose rows and columns span four decades, so blocks get very different scales."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)]
    cols = torch.logspace(-1, 0, k)[torch.randperm(k, generator=g)]
    return torch.randn(n, k, generator=g) * rows[:, None] * cols[None, :]


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _assert_close(y: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_matches_reference_128_blocks(m):
    weight, scale = quantize_fp8_block(_weight(256, 384), (128, 128))
    x = _x(m, 384)
    _assert_close(fp8_block_linear(x, weight, scale), fp8_block_linear_reference(x, weight, scale))


@pytest.mark.parametrize("n,k,m", [(96, 160, 3), (70, 45, 17)])
def test_kernel_ue8m0_32_blocks(n, k, m):
    """V4.1 layout: 32x32 blocks, power-of-two scales handed over as float8_e8m0fnu (exactly the float32 ones)."""
    weight, scale = quantize_fp8_block(_weight(n, k), (32, 32), ue8m0=True)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    e8m0 = scale.to(torch.float8_e8m0fnu)
    assert torch.equal(e8m0.float(), scale)
    x = _x(m, k)
    _assert_close(fp8_block_linear(x, weight, e8m0, (32, 32)), fp8_block_linear_reference(x, weight, e8m0, (32, 32)))


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (64, 256)])
def test_kernel_partial_edge_blocks_and_bias(block):
    """n, k are multiples of no block: the last block row and column are partial. (128, 128) splits a block over
    two BLOCK_N tiles, (64, 256) over two BLOCK_K tiles; both must still read that block's one scale."""
    n, k = 200, 300
    weight, scale = quantize_fp8_block(_weight(n, k), block)
    assert scale.shape == (-(-n // block[0]), -(-k // block[1]))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x = _x(7, k)
    y = fp8_block_linear(x, weight, scale, block, bias)
    _assert_close(y, fp8_block_linear_reference(x, weight, scale, block, bias))
    _assert_close(y - bias, fp8_block_linear(x, weight, scale, block), rtol=1e-4)


def test_kernel_leading_dims_bf16_output_and_empty():
    weight, scale = quantize_fp8_block(_weight(64, 96), (32, 32))
    x = _x(6, 96).view(2, 3, 96)
    _assert_close(fp8_block_linear(x, weight, scale, (32, 32)), fp8_block_linear_reference(x, weight, scale, (32, 32)))
    xb = x.to(torch.bfloat16)  # the interpreter computes in float32 and casts the result: one bf16 rounding
    _assert_close(fp8_block_linear(xb, weight, scale, (32, 32)),
                  fp8_block_linear_reference(xb, weight, scale, (32, 32)), rtol=2**-8)
    assert fp8_block_linear(x[:0], weight, scale, (32, 32)).shape == (0, 3, 64)


def test_kernel_rejects_bad_operands():
    weight, scale = quantize_fp8_block(_weight(64, 96), (32, 32))
    with pytest.raises(ValueError, match="scale shape"):
        fp8_block_linear(_x(2, 96), weight, scale, (64, 64))
    with pytest.raises(ValueError, match="features"):
        fp8_block_linear(_x(2, 95), weight, scale, (32, 32))
    with pytest.raises(ValueError, match="fp8"):
        fp8_block_linear(_x(2, 96), weight.float(), scale, (32, 32))
    with pytest.raises(ValueError, match="divisor"):
        tile_for(24, 64)  # 8 is its largest power-of-two divisor: below tl.dot's 16
    assert (tile_for(128, 64), tile_for(128, 128), tile_for(32, 64), tile_for(96, 128)) == (64, 128, 32, 32)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_quantize_error_within_half_an_e4m3_ulp(block, ue8m0):
    """|dequant - w| <= 2^-4 |w| (E4M3 has 3 mantissa bits) or, for values in E4M3's subnormal range, 2^-10 of
    the block scale (half the 2^-9 subnormal spacing); 1e-6 relative covers the float32 divide and multiply."""
    w = _weight(200, 300)
    w[:128, :128] = 0.0  # an all-zero block (128-blocks) / sixteen of them (32-blocks) stays exactly zero
    linear = nn.Linear(300, 200, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = FP8BlockLinear.quantize(linear, block, ue8m0)
    deq = layer.dequantized_weight()
    block_scale = layer.weight_scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:200, :300]
    bound = torch.maximum(2**-4 * w.abs(), 2**-10 * block_scale) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.equal(deq[:128, :128], torch.zeros(128, 128))
    assert (layer.weight.float().abs() <= 448).all() and layer.weight.float().abs().amax() >= 224


def test_layer_cpu_forward_equals_dequantized_reference():
    linear = nn.Linear(300, 200)
    layer = FP8BlockLinear.quantize(linear, (128, 128))
    x = _x(9, 300).view(3, 3, 300)
    expected = F.linear(x, dequantize_fp8_block(layer.weight, layer.weight_scale_inv, (128, 128)), linear.bias)
    assert torch.equal(layer(x), expected)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    _assert_close(fp8_block_linear(x, layer.weight, layer.weight_scale_inv, layer.block, layer.bias), expected)


def test_layer_memory_state_dict_and_dtype_casts():
    n, k = 200, 300
    layer = FP8BlockLinear.quantize(nn.Linear(k, n, bias=False), (128, 128))
    scale_bytes = 2 * 3 * 4
    assert layer.memory_bytes() == layer.weight.numel() + scale_bytes == n * k * 2 // 2 + scale_bytes
    assert not any(t.requires_grad for t in layer.state_dict().values())
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    layer.to(torch.bfloat16).half()  # dtype casts do not touch the quantised storage
    assert (layer.weight.dtype, layer.weight_scale_inv.dtype) == (torch.float8_e4m3fn, torch.float32)
    ue8m0 = FP8BlockLinear.quantize(nn.Linear(k, n), (32, 32), ue8m0=True)
    fresh = FP8BlockLinear(k, n, (32, 32), bias=True)
    fresh.load_state_dict({**ue8m0.state_dict(), "weight_scale_inv": ue8m0.weight_scale_inv.to(torch.float8_e8m0fnu)})
    assert torch.equal(fresh.dequantized_weight(), ue8m0.dequantized_weight())
    assert fresh.memory_bytes() == n * k + 7 * 10 * 4 + n * 4


def test_from_quantized_validates_and_converts_scales():
    weight, scale = quantize_fp8_block(_weight(64, 96), (32, 32), ue8m0=True)
    layer = FP8BlockLinear.from_quantized(weight, scale.to(torch.float8_e8m0fnu), (32, 32))
    assert (layer.in_features, layer.out_features, layer.block) == (96, 64, (32, 32))
    assert layer.weight is weight and torch.equal(layer.weight_scale_inv, scale)
    with pytest.raises(ValueError, match="scale shape"):
        FP8BlockLinear.from_quantized(weight, scale[:1], (32, 32))
