"""Fused routed-MoE kernels (kernels/fused_moe.py) against their torch reference under Triton's interpreter on CPU:
plain float32 weights, FP8 block-scaled (float and UE8M0 scales), MXFP4, the V4 clamp, and the alignment step."""

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.kernels.fused_moe as fm  # noqa: E402
from deepinfer.kernels.fused_moe import (  # noqa: E402
    MoeTiles,
    default_tiles,
    fused_moe,
    fused_moe_reference,
    moe_align,
    padded_capacity,
)
from deepinfer.layers.moe import routed_experts  # noqa: E402

SMALL = MoeTiles(block_m=16, block_n=32, block_k=32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _routing(t: int, k: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as a top-k router picks them) and normalised positive weights."""
    g = _gen(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def _plain(e: int, inter: int, d: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(e, 2 * inter, d, generator=g) / d**0.5, torch.randn(e, d, inter, generator=g) / inter**0.5


def _fp8(e: int, n: int, k: int, block: tuple[int, int], e8m0: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (clamped first: the fp32 -> fp8 cast does not saturate) and positive block scales."""
    g = _gen(seed)
    codes = (torch.randn(e, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (e, -(-n // block[0]), -(-k // block[1]))
    if e8m0:
        return codes, torch.exp2(torch.randint(-14, -9, grid, generator=g).float()).to(torch.float8_e8m0fnu)
    return codes, (torch.rand(grid, generator=g) + 0.5) / (64 * k**0.5)


def _mxfp4(e: int, n: int, k: int, e8m0: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    grid = (e, n, -(-k // 32))
    scale = torch.exp2(torch.randint(-6, -2, grid, generator=g).float())
    return codes, scale.to(torch.float8_e8m0fnu) if e8m0 else scale * (1 + torch.rand(grid, generator=g))


def _assert_close(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  rtol: float = 1e-5, tiles: MoeTiles = SMALL, **kw) -> torch.Tensor:
    out = fused_moe(x, ids, weights, w13, w2, tiles=tiles, **kw)
    ref = fused_moe_reference(x, ids, weights, w13, w2, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.abs().max().item())
    return out


# ------------------------------------------------------------------------------------------------ moe_align


@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_align_layout(block_m: int):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])  # expert 3 x5, 0 x2, 1 x2, 2 x1, 4-5 none
    slots, experts, num_valid = moe_align(ids, 6, block_m)
    n = ids.numel()
    counts = torch.bincount(ids.flatten(), minlength=6)
    assert slots.dtype == experts.dtype == torch.int32
    assert slots.numel() == padded_capacity(n, 6, block_m) and slots.numel() % block_m == 0
    assert experts.numel() == slots.numel() // block_m
    assert int(num_valid) == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = slots[slots < n]
    assert sorted(real.tolist()) == list(range(n))  # every slot once, the rest sentinels
    assert (slots[int(num_valid):] == n).all() and (experts[int(num_valid) // block_m:] == -1).all()
    flat = ids.flatten()
    for b, e in enumerate(experts.tolist()):
        tile = slots[b * block_m:(b + 1) * block_m]
        tile = tile[tile < n]
        if e >= 0:
            assert (flat[tile.long()] == e).all() and (tile.diff() > 0).all()  # one expert, stable order
    assert experts[experts >= 0].diff().ge(0).all()  # experts ascending, empty ones have no tile


def test_moe_align_multi_tile_expert_and_capacity():
    ids = torch.zeros(20, 1, dtype=torch.long)  # 20 slots of expert 0: two 16-tiles, the second padded
    slots, experts, num_valid = moe_align(ids, 4, 16)
    assert experts.tolist()[:2] == [0, 0] and int(num_valid) == 32
    assert slots[:20].tolist() == list(range(20)) and (slots[20:] == 20).all()
    assert padded_capacity(8, 256, 16) == 128  # decode: at most 8 non-empty experts
    assert padded_capacity(0, 4, 16) == 0


def test_default_tiles():
    assert default_tiles(8, 256).block_m == 16
    assert default_tiles(4096 * 8, 256).block_m == 64
    with pytest.raises(ValueError):
        MoeTiles(block_m=24)


# ------------------------------------------------------------------------------------------------ float weights


def test_fp32_matches_reference_and_is_deterministic():
    e, inter, d, t, k = 6, 96, 64, 10, 2  # I = 96: a partial N tile and a partial K tile of 32 / 64
    x = torch.randn(t, d, generator=_gen(2))
    ids, weights = _routing(t, k, e)
    w13, w2 = _plain(e, inter, d)
    out = _assert_close(x, ids, weights, w13, w2)
    assert torch.equal(out, fused_moe(x, ids, weights, w13, w2, tiles=SMALL))
    _assert_close(x, ids, weights, w13, w2, tiles=MoeTiles(block_m=32, block_n=64, block_k=64))


def test_experts_without_tokens():
    e, inter, d = 8, 32, 32
    x = torch.randn(6, d, generator=_gen(3))
    ids = torch.tensor([[1, 5]] * 3 + [[5, 1]] * 3)  # experts 0, 2-4, 6, 7 idle (the last one too)
    _assert_close(x, ids, torch.rand(6, 2, generator=_gen(4)), *_plain(e, inter, d))


def test_single_token():
    x = torch.randn(1, 64, generator=_gen(5))
    ids, weights = _routing(1, 2, 4, seed=6)
    _assert_close(x, ids, weights, *_plain(4, 64, 64))


def test_ragged_expert_counts():
    t, e, inter, d = 18, 5, 32, 32
    second = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 4, 4, 3, 1])
    ids = torch.stack([torch.zeros(t, dtype=torch.long), second], 1)  # expert 0 x18: two 16-row tiles
    _assert_close(torch.randn(t, d, generator=_gen(7)), ids, torch.rand(t, 2, generator=_gen(8)),
                  *_plain(e, inter, d))


def test_limit_clamps_gate_and_up():
    e, inter, d, t = 4, 32, 64, 8
    x = torch.randn(t, d, generator=_gen(9)) * 4
    ids, weights = _routing(t, 2, e, seed=10)
    w13, w2 = _plain(e, inter, d)
    clamped = _assert_close(x, ids, weights, w13, w2, limit=0.75)
    assert not torch.allclose(clamped, routed_experts(x, ids, weights, w13, w2), rtol=1e-3)  # the clamp binds


def test_bf16_activations():
    e, inter, d, t = 4, 32, 64, 5
    x = torch.randn(t, d, generator=_gen(11)).bfloat16()
    ids, weights = _routing(t, 2, e, seed=12)
    w13, w2 = _plain(e, inter, d)
    _assert_close(x, ids, weights, w13.bfloat16(), w2.bfloat16(), rtol=2e-2)


# ------------------------------------------------------------------------------------------------ quantised


def _fp8_case(e: int, inter: int, d: int, t: int, block: tuple[int, int], e8m0: bool, seed: int,
              tiles: MoeTiles = SMALL, limit: float = 0.0) -> None:
    x = torch.randn(t, d, generator=_gen(seed))
    ids, weights = _routing(t, 2, e, seed=seed + 1)
    w13, s13 = _fp8(e, 2 * inter, d, block, e8m0, seed + 2)
    w2, s2 = _fp8(e, d, inter, block, e8m0, seed + 3)
    _assert_close(x, ids, weights, w13, w2, tiles=tiles, limit=limit, w13_scale=s13, w2_scale=s2, quant="fp8",
                  block=block)


@pytest.mark.parametrize("block, inter, d", [((32, 32), 64, 64), ((64, 64), 96, 128), ((32, 64), 32, 128)])
def test_fp8_block_scaled(block: tuple[int, int], inter: int, d: int):
    _fp8_case(6, inter, d, 7, block, e8m0=False, seed=20)  # (64, 64) with I = 96: partial edge blocks


def test_fp8_128_blocks():
    _fp8_case(4, 128, 128, 4, (128, 128), e8m0=False, seed=30, tiles=MoeTiles(block_m=16, block_n=64, block_k=64))


def test_fp8_ue8m0_32_blocks_with_limit():
    _fp8_case(5, 64, 64, 9, (32, 32), e8m0=True, seed=40, limit=0.5)


@pytest.mark.parametrize("e8m0", [True, False])
def test_mxfp4(e8m0: bool):
    e, inter, d, t = 4, 64, 64, 6
    x = torch.randn(t, d, generator=_gen(50))
    ids, weights = _routing(t, 2, e, seed=51)
    w13, s13 = _mxfp4(e, 2 * inter, d, e8m0, 52)
    w2, s2 = _mxfp4(e, d, inter, e8m0, 53)
    _assert_close(x, ids, weights, w13, w2, w13_scale=s13, w2_scale=s2, quant="mxfp4",
                  tiles=MoeTiles(block_m=16, block_n=32, block_k=64))  # BLOCK_K 64: two scale groups per tile


def test_launcher_never_dequantises_whole_experts(monkeypatch: pytest.MonkeyPatch):
    e, inter, d, t = 4, 32, 32, 3
    w13, s13 = _fp8(e, 2 * inter, d, (32, 32), False, 60)
    w2, s2 = _fp8(e, d, inter, (32, 32), False, 61)
    x, (ids, weights) = torch.randn(t, d, generator=_gen(62)), _routing(t, 2, e, seed=63)
    ref = fused_moe_reference(x, ids, weights, w13, w2, w13_scale=s13, w2_scale=s2, quant="fp8", block=(32, 32))

    def forbidden(*args, **kwargs):
        raise AssertionError("whole-expert dequantisation in the launcher")

    monkeypatch.setattr(fm, "dequantize_experts", forbidden)
    out = fused_moe(x, ids, weights, w13, w2, w13_scale=s13, w2_scale=s2, quant="fp8", block=(32, 32), tiles=SMALL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_rejects_mismatched_operands():
    w13, s13 = _fp8(2, 64, 32, (32, 32), False, 70)
    w2, s2 = _fp8(2, 32, 32, (32, 32), False, 71)
    x, (ids, weights) = torch.randn(2, 32), _routing(2, 2, 2)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe(x, ids, weights, w13, w2, w13_scale=s13[:, :1], w2_scale=s2, quant="fp8", block=(32, 32))
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, ids, weights, w13, w2, quant=None)
    with pytest.raises(ValueError, match="no power-of-two divisor"):
        fused_moe(x, ids, weights, w13, w2, w13_scale=s13.repeat(1, 4, 4), w2_scale=s2.repeat(1, 4, 4),
                  quant="fp8", block=(8, 8))
