"""MLA absorbed paged decode kernel against its torch reference, under Triton's interpreter on CPU; the reference
itself against the model's decode math (MLAttention._absorbed_batch over _decode_batch's plan).

Pools start all NaN (and quantised pools with NaN scales): only rows of positions below a request's seq_len are
written, and block-table padding points at a spare NaN block, so any stray read shows up in the output."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.kernels.mla_decode as mla_decode_module  # noqa: E402
from deepinfer.kernels.mla_decode import mla_decode, mla_decode_reference  # noqa: E402
from deepinfer.layers.kv_quant import PagedPool, quantize  # noqa: E402
from deepinfer.layers.metadata import ForwardMeta  # noqa: E402
from deepinfer.models.deepseek_v3 import MLAttention, _decode_batch  # noqa: E402

LATENT, ROPE, PAGE = 24, 8, 4  # not powers of two: the kernel's padded tiles are masked
SCALE = 0.3
RAGGED = [1, 7, 37, 16]  # 37 crosses ten blocks and three BLOCK_N steps


def _table(lens: list[int], gen: torch.Generator, spare: int = 3) -> tuple[torch.Tensor, int]:
    """Unordered, non-contiguous block ids (some never used); padding entries name an unused block."""
    blocks = [-(-n // PAGE) for n in lens]
    ids = torch.randperm(sum(blocks) + spare, generator=gen).tolist()
    pad, rows, at = ids[-1], [], 0
    for b in blocks:
        rows.append(ids[at:at + b] + [pad] * (max(max(blocks), 1) - b))
        at += b
    return torch.tensor(rows, dtype=torch.int64), len(ids)


def _slots(table: torch.Tensor, lens: list[int]) -> list[list[int]]:
    return [[int(table[r, p // PAGE]) * PAGE + p % PAGE for p in range(n)] for r, n in enumerate(lens)]


def _case(lens: list[int], heads: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [R, H, D], pool [N, D] NaN outside the context rows, block table)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = _table(lens, gen)
    pool = torch.full((num_blocks * PAGE, LATENT + ROPE), float("nan"))
    for rows in _slots(table, lens):
        pool[rows] = torch.randn(len(rows), LATENT + ROPE, generator=gen)
    return torch.randn(len(lens), heads, LATENT + ROPE, generator=gen), pool, table


def _both(q, pool, scale, table, lens, attend=None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    seq_lens = torch.tensor(lens)
    want = mla_decode_reference(q, pool, scale, table, seq_lens, LATENT, SCALE, attend, block_size=PAGE)
    got = mla_decode(q, pool, scale, table, seq_lens, LATENT, SCALE, attend, block_size=PAGE, **kw)
    assert not want.isnan().any() and got.dtype == q.dtype and got.shape == want.shape
    return got, want


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_ragged_batch_through_holey_block_table(num_splits):
    q, pool, table = _case(RAGGED)
    got, want = _both(q, pool, None, table, RAGGED, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_merge_over_several_latent_tiles(monkeypatch):
    monkeypatch.setattr(mla_decode_module, "MERGE_TILE", 16)  # latent 24: two merge programs per head
    q, pool, table = _case(RAGGED, seed=9)
    got, want = _both(q, pool, None, table, RAGGED, num_splits=3, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_heads_not_a_multiple_of_the_head_block():
    lens = [9, 3]
    q, pool, table = _case(lens, heads=20, seed=1)
    got, want = _both(q, pool, None, table, lens, block_h=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [3, -5])  # the mask longer than the context, or shorter than the longest one
def test_attend_mask(extra):
    q, pool, table = _case(RAGGED, seed=2)
    attend = torch.rand(len(RAGGED), max(RAGGED) + extra, generator=torch.Generator().manual_seed(3)) < 0.5
    attend[0] = False  # nothing selected: zeros
    attend[1:, 0] = True
    got, want = _both(q, pool, None, table, RAGGED, attend, num_splits=2, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantised_pool_with_row_scales(dtype):
    q, pool, table = _case(RAGGED, seed=4)
    written = ~pool.isnan().any(dim=1)
    data = torch.full(pool.shape, float("nan") if dtype.is_floating_point else 127.0).to(dtype)
    scale = torch.full((pool.shape[0], 1), float("nan"))
    data[written], scale[written] = quantize(pool[written] * 3, dtype)
    got, want = _both(q, data, scale, table, RAGGED, num_splits=2, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[0, 5, 0], [0, 0]])
def test_empty_context_gives_zeros(lens):
    q, pool, table = _case(lens, seed=5)
    for splits in (1, 2):
        got, want = _both(q, pool, None, table, lens, num_splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_bfloat16_queries_keep_their_dtype():
    q, pool, table = _case([6, 13], seed=6)
    got, want = _both(q.bfloat16(), pool.bfloat16(), None, table, [6, 13])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- the reference is the model's math


def _meta(lens: list[int], table: torch.Tensor) -> ForwardMeta:
    """A decode-only step: one new token per request, already in the cache."""
    r = len(lens)
    return ForwardMeta(input_ids=torch.zeros(r, dtype=torch.long), positions=torch.tensor(lens) - 1,
                       token_req=torch.arange(r), block_table=table, state_slots=torch.arange(r),
                       logits_indices=torch.arange(r), query_start=list(range(r + 1)),
                       seq_starts=[n - 1 for n in lens], seq_lens=lens, block_size=PAGE)


@pytest.mark.parametrize("select", [False, True])
def test_reference_matches_the_model_absorbed_batch(select):
    heads, nope, v_dim = 3, 6, 5
    q, pool, table = _case(RAGGED, heads=heads, seed=7)
    gen = torch.Generator().manual_seed(8)
    w_uk, w_uv = torch.randn(heads, nope, LATENT, generator=gen), torch.randn(heads, v_dim, LATENT, generator=gen)
    q_nope, q_pe = torch.randn(len(RAGGED), heads, nope, generator=gen), q[..., LATENT:]
    batch = _decode_batch(_meta(RAGGED, table), list(range(len(RAGGED))))
    attend = None
    if select:
        attend = (torch.rand(batch.valid.shape, generator=gen) < 0.5) & batch.valid
        attend[torch.arange(len(RAGGED)), torch.tensor(RAGGED) - 1] = True  # the new token is always selected
        batch = replace(batch, attend=attend)
    layer = SimpleNamespace(_w_kv_b=lambda: (w_uk, w_uv), scale=SCALE, latent=LATENT)
    model = MLAttention._absorbed_batch(layer, q_nope, q_pe, PagedPool(pool, None, torch.float32), batch)
    q_abs = torch.cat([torch.einsum("rhd,hdc->rhc", q_nope, w_uk), q_pe], dim=-1)
    seq_lens = torch.tensor(RAGGED)
    o_c = mla_decode_reference(q_abs, pool, None, table, seq_lens, LATENT, SCALE, attend, block_size=PAGE)
    torch.testing.assert_close(torch.einsum("rhc,hvc->rhv", o_c, w_uv), model, atol=1e-5, rtol=1e-5)
    kernel = mla_decode(q_abs, pool, None, table, seq_lens, LATENT, SCALE, attend, block_size=PAGE, num_splits=2)
    torch.testing.assert_close(kernel, o_c, atol=1e-5, rtol=1e-5)
