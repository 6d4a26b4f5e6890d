"""V4 sparse attention kernel (window ring + compressed entries + sink) against its torch reference, under
Triton's interpreter on CPU; the reference itself against the model's own plans (models/v4_plan.py)."""

import pytest
import torch

pytest.importorskip("triton")

from ragged_steps import ragged_step  # noqa: E402

from deepinfer.kernels.sparse_attention import (  # noqa: E402
    EntrySource,
    WindowSource,
    sparse_attention,
    sparse_attention_reference,
)
from deepinfer.layers.attention import sink_attention  # noqa: E402
from deepinfer.layers.kv_quant import quantize  # noqa: E402
from deepinfer.layers.metadata import ForwardMeta  # noqa: E402
from deepinfer.models.v4_plan import compress_plan, window_plan  # noqa: E402

HEADS, DIM, WINDOW, LOOKAHEAD, PER_BLOCK = 5, 16, 6, 2, 4


def _step(starts: list[int], news: list[int], block_size: int = 16) -> ForwardMeta:
    return ragged_step(starts, news, block_size)


def _ring(meta: ForwardMeta, ring_len: int) -> torch.Tensor:
    """Ring state holding positions [s - L, s) of each request; every other row NaN (never to be read)."""
    ring = torch.full(((len(meta.seq_starts) + 2) * ring_len, DIM), float("nan"))
    for r, s in enumerate(meta.seq_starts):
        for p in range(max(0, s - ring_len), s):
            ring[int(meta.state_slots[r]) * ring_len + p % ring_len] = torch.randn(DIM)
    return ring


def _window(meta: ForwardMeta, new_kv: torch.Tensor, ring: torch.Tensor) -> WindowSource:
    starts = torch.tensor(meta.seq_starts)[meta.token_req]
    qstarts = torch.tensor(meta.query_start[:-1])[meta.token_req]
    return WindowSource(ring, WINDOW + LOOKAHEAD, WINDOW, new_kv, meta.state_slots[meta.token_req], starts,
                        qstarts, meta.positions)


def _pool(meta: ForwardMeta, ratio: int) -> torch.Tensor:
    """Entries of every completed window in their paged rows; unreferenced rows NaN."""
    rows = (int(meta.block_table.max()) + 1) * PER_BLOCK
    pool = torch.full((rows, DIM), float("nan"))
    for r, end in enumerate(meta.seq_lens):
        for e in range(end // ratio):
            pool[int(meta.block_table[r, e // PER_BLOCK]) * PER_BLOCK + e % PER_BLOCK] = torch.randn(DIM)
    return pool


def _case(starts, news, seed=0):
    torch.manual_seed(seed)
    meta = _step(starts, news, block_size=PER_BLOCK * 4)
    t = meta.num_tokens
    q, new_kv = torch.randn(t, HEADS, DIM), torch.randn(t, DIM)
    return meta, q, _window(meta, new_kv, _ring(meta, WINDOW + LOOKAHEAD)), torch.randn(HEADS)


def _check(q, window, entries, sinks):
    want = sparse_attention_reference(q, window, entries, sinks, DIM**-0.5)
    got = sparse_attention(q, window, entries, sinks, DIM**-0.5)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("starts,news", [([9, 0, 3], [1, 1, 1]), ([0, 12], [7, 3]), ([2], [1])])
def test_window_only(starts, news):
    meta, q, window, sinks = _case(starts, news)
    _check(q, window, None, sinks)


def test_hca_entries_all_visible():
    meta, q, window, sinks = _case([40, 5, 0], [1, 9, 1])
    visible = (meta.positions + 1) // 4
    _check(q, window, EntrySource(_pool(meta, 4), None, meta.block_table, meta.token_req, PER_BLOCK,
                                  visible=visible), sinks)


def test_csa_topk_entries_with_holes_and_empty_rows():
    meta, q, window, sinks = _case([30, 0, 17], [1, 2, 4])
    visible = (meta.positions + 1) // 4
    ids = torch.full((meta.num_tokens, 5), -1, dtype=torch.long)
    for t, n in enumerate(visible.tolist()):
        chosen = torch.randperm(n)[:5] if n else torch.empty(0, dtype=torch.long)
        ids[t, :len(chosen)] = chosen
    assert (ids < 0).all(dim=1).any()  # a token with an empty selection
    _check(q, window, EntrySource(_pool(meta, 4), None, meta.block_table, meta.token_req, PER_BLOCK,
                                  entry_ids=ids), sinks)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantised_pool(dtype):
    meta, q, window, sinks = _case([21, 8], [1, 1])
    pool = _pool(meta, 4)
    finite = ~pool.isnan().any(dim=1)
    data, scale = torch.zeros(pool.shape, dtype=dtype), torch.full((pool.shape[0], 1), float("nan"))
    data[finite], scale[finite] = quantize(pool[finite], dtype)
    visible = (meta.positions + 1) // 4
    _check(q, window, EntrySource(data, scale, meta.block_table, meta.token_req, PER_BLOCK, visible=visible),
           sinks)


def test_sink_only_query_outputs_zero():
    """A position-0 query of a layer whose window keys are all masked out still gets the sink: output 0."""
    meta, q, window, sinks = _case([0], [1])
    empty = WindowSource(window.ring, window.ring_len, 0, window.new_kv, window.token_slot, window.token_start,
                         window.token_qstart, window.positions)
    got = sparse_attention(q, empty, None, sinks, DIM**-0.5)
    assert torch.equal(got, torch.zeros_like(got))


def test_reference_follows_the_model_plans():
    """The reference's window and entry gathers are the model's (WindowPlan / CompressPlan) ones."""
    meta, q, window, sinks = _case([11, 0, 6], [1, 5, 2])
    plan = window_plan(meta, WINDOW, LOOKAHEAD)
    ring_keys = plan.source.gather(window.ring, window.new_kv, plan.key_idx)
    pool = _pool(meta, 4)
    cplan = compress_plan(meta, 4, True, LOOKAHEAD)
    keys = torch.cat([ring_keys, pool[cplan.query_entries]], 1)
    valid = torch.cat([plan.key_valid, cplan.query_valid], 1)
    want = sink_attention(q, keys.masked_fill(~valid[..., None], 0), valid, sinks, DIM**-0.5)
    entries = EntrySource(pool, None, meta.block_table, meta.token_req, PER_BLOCK, visible=(meta.positions + 1) // 4)
    torch.testing.assert_close(sparse_attention_reference(q, window, entries, sinks, DIM**-0.5), want)
