"""Lightning Indexer kernels (paged scoring + exact top-k) against their torch reference under Triton's interpreter
on CPU; the reference itself against the models' own selection (V4's Indexer.select over v4_plan's entries, V3.2's
dsa.Indexer.select_decode)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from ragged_steps import ragged_step  # noqa: E402

from deepinfer.kernels.indexer import (  # noqa: E402
    gather_entry_rows,
    indexer_scores,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
    select_topk,
    select_topk_reference,
)
from deepinfer.layers.kv_quant import PagedPool, quantize  # noqa: E402
from deepinfer.layers.metadata import ForwardMeta  # noqa: E402
from deepinfer.models import dsa  # noqa: E402
from deepinfer.models.deepseek_v4 import Indexer  # noqa: E402
from deepinfer.models.v4_plan import _query_entries, tile_plan, window_plan  # noqa: E402

HEADS, DIM, PER_BLOCK, TOPK = 4, 16, 4, 4
NAN = float("nan")
# a ragged batch: request of each token and its visible entry count (0, fewer than TOPK, more, several blocks)
REQ, VISIBLE = [0, 0, 0, 1, 1, 2, 2, 2], [0, 5, 9, 13, 2, 6, 1, 4]


def _table(n_entries: list[int], seed: int) -> torch.Tensor:
    """Shuffled block ids with holes between them; unused slots point at a spare block nobody writes."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // PER_BLOCK) for n in n_entries]
    ids = torch.randperm(sum(blocks) + 4, generator=g).tolist()
    spare, width, rows, at = ids.pop(), max(max(blocks), 1), [], 0
    for b in blocks:
        rows.append(ids[at:at + b] + [spare] * (width - b))
        at += b
    return torch.tensor(rows)


def _paged(values: torch.Tensor, table: torch.Tensor, n_entries: list[int]) -> torch.Tensor:
    """Pool [rows, d] holding values[r, e] at entry e of request r; every other row NaN."""
    pool = torch.full(((int(table.max()) + 1) * PER_BLOCK, values.shape[-1]), NAN)
    for r, n in enumerate(n_entries):
        for e in range(n):
            pool[int(table[r, e // PER_BLOCK]) * PER_BLOCK + e % PER_BLOCK] = values[r, e]
    return pool


def _batch(req: list[int], visible: list[int], seed: int = 0, values: torch.Tensor | None = None):
    """(token_req, visible, block_table, float32 pool, n_entries) with request r's entries values[r] (random)."""
    n_entries = [max([v for q, v in zip(req, visible) if q == r], default=0) for r in range(max(req) + 1)]
    torch.manual_seed(seed)
    values = torch.randn(len(n_entries), max(n_entries), DIM) if values is None else values
    table = _table(n_entries, seed)
    return torch.tensor(req), torch.tensor(visible), table, _paged(values, table, n_entries), n_entries


def _args(seed: int = 0, req=REQ, visible=VISIBLE, values=None, dtype=torch.float32):
    token_req, vis, table, pool, _ = _batch(req, visible, seed, values)
    q = torch.randn(len(req), HEADS, DIM).to(dtype)
    w = torch.randn(len(req), HEADS) * HEADS**-0.5
    return q, w, pool.to(dtype), None, table, token_req, vis


def _quantized(args: tuple, dtype: torch.dtype) -> tuple:
    """The same batch with its pool quantised per row (NaN rows keep a NaN scale)."""
    q, w, pool, _, *rest = args
    used = ~pool.isnan().any(dim=1)
    data = torch.zeros(pool.shape, dtype=dtype)
    scale = torch.full((pool.shape[0], 1), NAN)
    data[used], scale[used] = quantize(pool[used], dtype)
    return (q, w, data, scale, *rest)


def _sets(indices: torch.Tensor, valid: torch.Tensor) -> list[set[int]]:
    return [set(row[ok].tolist()) for row, ok in zip(indices, valid)]


def _assert_same_topk(got: tuple, want: tuple) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.bool
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _integer_case(seed: int, distinct: int) -> tuple:
    """Small-integer q, w and keys (scale 1/4): every score exact in float32 whatever the summation order. Only
    `distinct` different key vectors, so scores repeat (duplicated keys) and ReLU zeros are common."""
    g = torch.Generator().manual_seed(seed)
    palette = torch.randint(-2, 3, (distinct, DIM), generator=g).float()
    n = max(VISIBLE)
    values = palette[torch.randint(0, distinct, (3, n), generator=g)]
    q, _, pool, _, table, token_req, vis = _args(seed, values=values)
    q = torch.randint(-2, 3, q.shape, generator=g).float()
    w = torch.randint(-2, 3, (len(REQ), HEADS), generator=g).float() * 0.5
    return q, w, pool, None, table, token_req, vis


# ------------------------------------------------------------------------------------------------- scores


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_scores_match_reference(pool_dtype):
    args = _args(seed=1, dtype=torch.bfloat16 if pool_dtype == torch.bfloat16 else torch.float32)
    if pool_dtype in (torch.float8_e4m3fn, torch.int8):
        args = _quantized(args, pool_dtype)
    got, want = indexer_scores(*args, PER_BLOCK, DIM**-0.5), indexer_scores_reference(*args, PER_BLOCK, DIM**-0.5)
    assert got.shape == (len(REQ), max(VISIBLE)) and got.dtype == torch.float32
    invalid = torch.arange(max(VISIBLE))[None, :] >= torch.tensor(VISIBLE)[:, None]
    assert torch.isneginf(got[invalid]).all() and torch.isneginf(want[invalid]).all()
    assert torch.isfinite(got[~invalid]).all()  # no NaN row (hole, spare block) was read
    torch.testing.assert_close(got[~invalid], want[~invalid], rtol=1e-5, atol=1e-5)


def test_scores_default_scale_and_extra_columns():
    args = _args(seed=2)
    got = indexer_scores(*args, PER_BLOCK, max_entries=20)
    want = indexer_scores_reference(*args, PER_BLOCK, DIM**-0.5, max_entries=20)
    assert got.shape == (len(REQ), 20) and torch.isneginf(got[:, max(VISIBLE):]).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scores_many_heads_and_wide_keys():
    """More heads than one head block and a head dim that is not a power of two."""
    token_req, vis, table, _, n_entries = _batch(REQ, VISIBLE, seed=3)
    pool = _paged(torch.randn(3, max(VISIBLE), 24), table, n_entries)
    q, w = torch.randn(len(REQ), 70, 24), torch.rand(len(REQ), 70)
    args = (q, w, pool, None, table, token_req, vis, PER_BLOCK)
    torch.testing.assert_close(indexer_scores(*args), indexer_scores_reference(*args), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- top-k


def _tricky_scores() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ties (zeros of both signs, repeated values), valid NaN / -inf entries, and invalid columns that
    would win were they considered (+inf, NaN, huge)."""
    g = torch.Generator().manual_seed(4)
    e = 300  # more than one block of the row scans
    scores = torch.randint(0, 3, (9, e), generator=g).float() * torch.randint(-1, 2, (9, e), generator=g).float()
    scores[1] = -0.0
    scores[1, ::7] = 0.0
    scores[2, 5], scores[2, 9], scores[2, 40] = NAN, NAN, float("inf")
    scores[2, 7] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)  # a NaN with the sign bit set
    scores[3, :6] = float("-inf")
    scores[4] = torch.randn(e, generator=g)
    scores[5] = torch.randn(e, generator=g).round(decimals=1)
    visible = torch.tensor([0, 299, 300, 7, 260, 3, 1, 2, 64])
    for row, n in enumerate(visible.tolist()):
        scores[row, n:] = torch.tensor([float("inf"), NAN, 1e30]).repeat(e)[: e - n]
    return scores, visible


@pytest.mark.parametrize("topk", [1, 4, 5, 300, 310])
def test_topk_exact_on_same_scores(topk):
    scores, visible = _tricky_scores()
    got, want = select_topk(scores, visible, topk), select_topk_reference(scores, visible, topk)
    _assert_same_topk(got, want)
    assert (want[1].sum(1) == visible.clamp(max=topk)).all()
    assert all((row[ok] < n).all() for row, ok, n in zip(*want, visible.tolist()))


def test_topk_ties_go_to_lower_indices():
    scores = torch.zeros(3, 12)
    scores[1, 8:] = 1.0
    scores[2] = -0.0
    scores[2, 3] = 0.0
    got = select_topk(scores, torch.tensor([12, 10, 12]), 3)[0]
    assert got.tolist() == [[0, 1, 2], [0, 8, 9], [0, 1, 2]]


@pytest.mark.parametrize("distinct", [1, 3])
def test_indexer_topk_exact_ties(distinct):
    """End to end with exact scores and massive ties: identical to the reference, not merely as sets."""
    args = _integer_case(seed=5 + distinct, distinct=distinct)
    scores = indexer_scores_reference(*args, PER_BLOCK, 0.25)
    assert torch.equal(indexer_scores(*args, PER_BLOCK, 0.25), scores)
    ranked = scores.sort(dim=1, descending=True).values
    assert any(ranked[t, TOPK - 1] == ranked[t, TOPK] for t, n in enumerate(VISIBLE) if n > TOPK)  # boundary ties
    _assert_same_topk(indexer_topk(*args, PER_BLOCK, TOPK, 0.25), indexer_topk_reference(*args, PER_BLOCK, TOPK, 0.25))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float8_e4m3fn])
def test_indexer_topk_random(pool_dtype):
    args = _args(seed=6)
    if pool_dtype != torch.float32:
        args = _quantized(args, pool_dtype)
    got = indexer_topk(*args, PER_BLOCK, TOPK)
    _assert_same_topk(got, select_topk_reference(indexer_scores(*args, PER_BLOCK), args[-1], TOPK))
    want = indexer_topk_reference(*args, PER_BLOCK, TOPK)
    assert _sets(*got) == _sets(*want)
    assert got[1].sum(1).tolist() == [min(v, TOPK) for v in VISIBLE]
    assert (got[0][:, :TOPK][~got[1]] == -1).all() and (got[0][0] == -1).all()  # visible 0: empty top-k


def test_empty_batch():
    q, w, pool, _, table, _, _ = _args()
    empty = (q[:0], w[:0], pool, None, table, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    indices, valid = indexer_topk(*empty, PER_BLOCK, TOPK)
    assert indices.shape == (0, TOPK) and valid.shape == (0, TOPK)


# -------------------------------------------------------------------------------- the models' own selection


def _v4_step(starts: list[int], news: list[int], block_size: int) -> ForwardMeta:
    ends = [s + n for s, n in zip(starts, news)]
    table = _table([-(-e // block_size) * PER_BLOCK for e in ends], seed=7)  # PER_BLOCK entries per block
    meta = ragged_step(starts, news, block_size, table)
    return replace(meta, state_slots=torch.arange(len(news)))


def _v4_indexer() -> Indexer:
    cfg = SimpleNamespace(index_n_heads=HEADS, index_head_dim=DIM, index_topk=TOPK, q_lora_rank=HEADS * DIM,
                          hidden_size=HEADS, rms_norm_eps=1e-6)
    indexer = Indexer(cfg, ratio=4)
    with torch.no_grad():  # q = qr and weights = x * n_heads**-0.5 exactly
        indexer.wq_b.weight.copy_(torch.eye(HEADS * DIM))
        indexer.weights_proj.weight.copy_(torch.eye(HEADS))
    return indexer


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiles"])
def test_reference_matches_v4_indexer_select(tiled):
    """The torch path's select (row by row, or tiled: the first request's 40 queries in tiles of 4, whose rows see
    different entry counts, the others row by row) chooses the kernel reference's entries."""
    ratio, block_size = 4, 16  # per_block = block_size // ratio entries per block
    meta = _v4_step([0, 9, 30], [40, 3, 2], block_size)
    tiles = tile_plan(meta, window_plan(meta, 8).source, 8, rows=4, min_queries=4) if tiled else None
    rows, valid = _query_entries(meta, ratio)
    visible = (meta.positions + 1) // ratio
    g = torch.Generator().manual_seed(8)
    pool = torch.full(((int(meta.block_table.max()) + 2) * PER_BLOCK, DIM), NAN)
    used = rows[valid].unique()
    pool[used] = torch.randint(-2, 3, (used.numel(), DIM), generator=g).float()
    t = meta.num_tokens
    q, x = torch.randint(-2, 3, (t, HEADS, DIM), generator=g).float(), torch.randint(-2, 3, (t, HEADS), generator=g)
    x = x.float()
    rope = (torch.ones(t, 4), torch.zeros(t, 4))  # identity rotation
    ctx = SimpleNamespace(rope={"compress": rope}, use_kernels=False, tiles=tiles)
    with torch.no_grad():
        order, ok = _v4_indexer().select(x, q.reshape(t, -1), ctx,
                                         PagedPool(pool, None, torch.float32), SimpleNamespace(query_entries=rows,
                                                                                               query_valid=valid))
    args = (q, x * HEADS**-0.5, pool, None, meta.block_table, meta.token_req, visible, PER_BLOCK, TOPK)
    assert torch.equal(gather_entry_rows(meta.block_table, meta.token_req, visible, PER_BLOCK, rows.shape[1])[1],
                       valid)
    want = indexer_topk_reference(*args)
    assert _sets(order, ok) == _sets(*want)
    _assert_same_topk(indexer_topk(*args), want)


def test_reference_matches_v32_dsa_select_decode():
    """V3.2: one key per token (per_block = block_size), visible = position + 1."""
    visible = [3, 9, 14, 1]
    token_req = list(range(len(visible)))
    g = torch.Generator().manual_seed(9)
    values = torch.randint(-2, 3, (len(visible), max(visible), DIM), generator=g).float()
    req, vis, table, pool, _ = _batch(token_req, visible, values=values)
    cfg = SimpleNamespace(index_n_heads=HEADS, index_head_dim=DIM, index_topk=TOPK, qk_rope_head_dim=8,
                          q_lora_rank=8, hidden_size=8)
    q = torch.randint(-2, 3, (len(visible), HEADS, DIM), generator=g).float()
    w = torch.randint(-2, 3, (len(visible), HEADS), generator=g).float() * HEADS**-0.5
    slots, valid = gather_entry_rows(table, req, vis, PER_BLOCK, max(visible))
    chosen = dsa.Indexer(cfg, torch.float32, "cpu").select_decode(q, w, PagedPool(pool, None, torch.float32), slots,
                                                                   valid)
    args = (q, w, pool, None, table, req, vis, PER_BLOCK, TOPK)
    want = indexer_topk_reference(*args)
    assert [set(row.nonzero().flatten().tolist()) for row in chosen] == _sets(*want)
    _assert_same_topk(indexer_topk(*args), want)
