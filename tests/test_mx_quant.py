"""layers/mx_quant.py against hand cases and independent formulations (the V4.1 goldens check it end to end)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.layers import mx_quant as M


def test_pow2_scale_is_the_next_power_of_two():
    amax = torch.tensor([448.0, 449.0, 1.0, 3.0, 1e-4])
    want = [2.0 ** math.ceil(math.log2(a * (1 / 448))) for a in amax.tolist()]
    assert M.pow2_scale(amax, torch.tensor(1 / 448)).tolist() == pytest.approx(want, rel=0)


def test_fp4_rounds_to_nearest_even_with_ties_up_to_even_codes():
    # one group of 32 whose absmax 6 gives scale 1, so the values are rounded as they are
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 6.0] + [0.0] * 23
    got = M.qdq(torch.tensor(values).bfloat16().view(1, 32), "fp4")[0, :9].float().tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp4_e4m3"])
def test_packed_codes_decode_to_the_qdq_values(fmt):
    x = (torch.randn(40, 256) * 10 ** torch.randn(40, 1)).bfloat16()
    codes, scales = M.encode(x, fmt)
    assert (codes.shape[-1], scales.shape[-1]) == M.packed_shapes(256, fmt)
    assert torch.equal(M.decode(codes, scales, fmt), M.qdq(x, fmt))
    if fmt != "fp4_e4m3":  # with power-of-two scales a QDQ point is idempotent (E4M3 scales follow the absmax)
        assert torch.equal(M.qdq(M.qdq(x, fmt), fmt), M.qdq(x, fmt))


def test_block_scaled_linear_is_the_product_of_the_qdq_activations():
    x, w = torch.randn(5, 128).bfloat16(), torch.randn(64, 128).bfloat16().float()
    exact = (M.fp8_qdq_float(x).double() @ w.double().T).to(torch.bfloat16)
    got = M.block_scaled_linear(x, w)
    assert (got.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2**-7
