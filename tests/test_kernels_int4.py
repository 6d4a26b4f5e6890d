"""Packed int4 (AWQ / GPTQ) kernels under Triton's interpreter on CPU: the W4A16 GEMM (kernels/int4_gemm.py) and
the fused MoE's int4 mode (kernels/fused_moe.py), each against its torch reference, and the layers routing to
them (Int4Linear, packed ParallelExperts) when the Triton paths are forced on.

Activations are float32 (the interpreter's bf16 tl.dot is not exact): kernel and reference differ only in
float32 summation order, ~1e-5 relative."""

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.layers.int4_linear as int4_linear_module  # noqa: E402
import deepinfer.layers.moe as moe_module  # noqa: E402
from deepinfer.kernels.fused_moe import MoeTiles, fused_moe, fused_moe_reference  # noqa: E402
from deepinfer.kernels.int4_gemm import int4_linear, int4_linear_reference  # noqa: E402
from deepinfer.layers.int4_linear import Int4Linear, group_params, pack_nibbles  # noqa: E402
from deepinfer.layers.moe import ExpertQuant, routed_experts  # noqa: E402
from deepinfer.quantization.int4 import quantize_int4  # noqa: E402


def _close(y: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


def _packed(n: int, k: int, group: int, seed: int, lead: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=g) * torch.logspace(-2, 0, k)[torch.randperm(k, generator=g)]
    q = [quantize_int4(m, group) for m in w.reshape(-1, n, k)]
    codes = torch.stack([pack_nibbles(x.codes) for x in q]).view(*lead, n, k // 2)
    params = torch.stack([group_params(x.scales, x.zeros) for x in q]).view(*lead, n, k // group, 2)
    return codes, params


@pytest.mark.parametrize("n, k, group, m", [(64, 128, 128, 1), (48, 96, 32, 7), (40, 256, 64, 33)])
def test_gemm_matches_reference(n, k, group, m):
    codes, params = _packed(n, k, group, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    _close(int4_linear(x, codes, params, group), int4_linear_reference(x, codes, params, group))


def test_gemm_rejects_mismatched_operands():
    codes, params = _packed(16, 64, 32, seed=0)
    with pytest.raises(ValueError, match="params shape"):
        int4_linear(torch.randn(2, 64), codes, params[:, :1], 32)
    with pytest.raises(ValueError, match="features"):
        int4_linear(torch.randn(2, 32), codes, params, 32)


def test_linear_layer_takes_the_kernel_when_triton_is_on(monkeypatch):
    w = quantize_int4(torch.randn(32, 64), 32)
    layer = Int4Linear(w)
    x = torch.randn(5, 64)
    eager = layer(x)
    assert torch.equal(eager, torch.nn.functional.linear(x, w.dequantize()))  # off Triton: the dequantised layer
    monkeypatch.setattr(int4_linear_module, "triton_enabled", lambda t: True)
    _close(layer(x), eager)


@pytest.mark.parametrize("group", [32, 64])
def test_fused_moe_int4(group, monkeypatch):
    e, inter, d, t = 4, 64, 128, 6
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))[:2] for i in range(t)])
    weights = torch.rand(t, 2, generator=torch.Generator().manual_seed(3))
    w13, p13 = _packed(2 * inter, d, group, 4, (e,))
    w2, p2 = _packed(d, inter, group, 5, (e,))
    kw = dict(w13_scale=p13, w2_scale=p2, quant="int4", block=(1, group))
    out = fused_moe(x, ids, weights, w13, w2, tiles=MoeTiles(block_m=16, block_n=32, block_k=64), **kw)
    _close(out, fused_moe_reference(x, ids, weights, w13, w2, **kw))
    # routed_experts on packed weights: the kernel when Triton is on, the per-call dequantisation otherwise
    w13.expert_quant, w2.expert_quant = ExpertQuant("int4", p13, (1, group)), ExpertQuant("int4", p2, (1, group))
    eager = routed_experts(x, ids, weights, w13, w2)
    _close(eager, out)
    monkeypatch.setattr(moe_module, "triton_enabled", lambda t: True)
    _close(routed_experts(x, ids, weights, w13, w2), eager)
