"""Tensor parallelism (deepinfer/distributed/tp.py): pure sharding units, then the TP modules over gloo on
loopback against the unsharded torch ops.

Each world runs every case in sequence in one WorkerGroup (tp_workers.tp_modules), empty batches included, with
a 30 s group timeout so a missed collective fails instead of hanging. Exactness: the vocab-parallel embedding
and pre-sliced vs from-full construction are bit-identical (asserted); row-parallel sums are split across
ranks, so those outputs are compared within 1e-5 (fp32) and 2e-2 (bf16, atol and rtol)."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from tp_workers import GROUPS, HEADS, INTER, VOCAB, Case

import deepinfer.distributed.tp as tp
from deepinfer.config import ParallelConfig
from deepinfer.distributed.launcher import WorkerGroup, WorkerOptions

OPTIONS = WorkerOptions(pg_timeout_s=tp_workers.GROUP_TIMEOUT_S, heartbeat_s=0.2, hang_timeout_s=30, join_timeout_s=3)
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
CASES = [Case(0, (7,)), Case(1, (0,)), Case(2, (2, 3)), Case(3, (5,), limit=0.5), Case(4, (7,), torch.bfloat16),
         Case(5, (0,), torch.bfloat16), Case(6, (6,), torch.bfloat16, limit=0.5), Case(7, (0, 3))]
# per run_full: row, row_full_input, embed, tiny_embed, mlp, v4_out all-reduce; column, head, tiny_head all-gather
COLLECTIVES = {"all_reduce": 6, "all_gather": 3}


def _ranks(size: int) -> list[tp.TPRank]:
    return [tp.TPRank(r, size) for r in range(size)]


# ------------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_and_row_shards_tile_the_weight_and_own_their_storage(size):
    w = torch.randn(8, 12)
    cols = [tp.column_shard(w, r, "w") for r in _ranks(size)]
    rows = [tp.row_shard(w, r, "w") for r in _ranks(size)]
    assert torch.equal(torch.cat(cols, 0), w) and torch.equal(torch.cat(rows, 1), w)
    assert all(s.is_contiguous() and s.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
               for s in cols + rows)


def test_non_divisible_sizes_name_the_tensor_and_the_size():
    with pytest.raises(ValueError, match="wq_b: output features 6 is not divisible by tensor-parallel size 4"):
        tp.column_shard(torch.zeros(6, 8), tp.TPRank(0, 4), "wq_b")
    with pytest.raises(ValueError, match="wo_b: input features 6 is not divisible by tensor-parallel size 4"):
        tp.row_shard(torch.zeros(8, 6), tp.TPRank(0, 4), "wo_b")
    with pytest.raises(ValueError, match="wq_b: heads 6 is not divisible by tensor-parallel size 4"):
        tp.head_shard(torch.zeros(24, 8), 6, tp.TPRank(0, 4), "wq_b")
    with pytest.raises(ValueError, match=r"kv_b: dim 0 of shape \(10, 4\) is not a whole number of 4 heads"):
        tp.head_shard(torch.zeros(10, 4), 4, tp.TPRank(0, 2), "kv_b")
    with pytest.raises(ValueError, match="wo_a: groups 8 is not divisible by tensor-parallel size 3"):
        tp.group_shard(torch.zeros(16, 4), 8, tp.TPRank(0, 3), "wo_a")
    with pytest.raises(ValueError, match="TP rank 2 is outside TP size 2"):
        tp.TPRank(2, 2)


@pytest.mark.parametrize("size", [2, 4])
def test_head_shards_keep_whole_heads(size):
    """V4 wq_b / MLA q_b and kv_b rows are heads-outermost; o_proj's columns likewise; attn_sink per head."""
    heads, per_head, latent = 8, 5, 3
    kv_b = torch.randn(heads * per_head, latent)
    o_proj, sink = torch.randn(latent, heads * per_head), torch.randn(heads)
    for r in _ranks(size):
        mine = range(r.rank * heads // size, (r.rank + 1) * heads // size)
        expect = kv_b.view(heads, per_head, latent)[mine.start:mine.stop].reshape(-1, latent)
        assert torch.equal(tp.head_shard(kv_b, heads, r, "kv_b"), expect)
        assert torch.equal(tp.head_shard(o_proj, heads, r, "o_proj", dim=1), o_proj[:, mine.start * per_head:
                                                                                     mine.stop * per_head])
        assert torch.equal(tp.head_shard(sink, heads, r, "attn_sink"), sink[mine.start:mine.stop])


def test_kv_heads_split_or_replicate():
    wkv = torch.randn(4, 6)  # V4: one shared KV head of 4 dims (K is V)
    assert all(torch.equal(tp.kv_head_shard(wkv, 1, r, "wkv"), wkv) for r in _ranks(4))
    gqa = torch.arange(8.0).view(8, 1)  # 2 KV heads of 4 rows over 4 ranks: ranks 0, 1 read head 0
    assert [tp.kv_head_shard(gqa, 2, r, "wk")[0, 0].item() for r in _ranks(4)] == [0, 0, 4, 4]
    assert torch.equal(tp.kv_head_shard(gqa, 2, tp.TPRank(1, 2), "wk"), gqa[4:])
    with pytest.raises(ValueError, match="3 KV heads neither divide nor are a divisor of TP size 4"):
        tp.kv_head_shard(torch.zeros(6, 2), 3, tp.TPRank(0, 4), "wk")
    assert tp.replicate(wkv) is wkv


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_v4_wo_a_groups_over_ranks(size):
    """wo_a [G * o_lora, H d / G]: rank r holds groups [r G / T, (r + 1) G / T), whole."""
    groups, o_lora = 8, 3
    wo_a = torch.randn(groups * o_lora, 5)
    shards = [tp.group_shard(wo_a, groups, r, "wo_a") for r in _ranks(size)]
    assert all(s.shape == (groups // size * o_lora, 5) for s in shards) and torch.equal(torch.cat(shards), wo_a)


@pytest.mark.parametrize("vocab,size,blocks", [(37, 2, [19, 18]), (37, 4, [10, 10, 10, 7]), (3, 4, [1, 1, 1, 0]),
                                               (8, 2, [4, 4])])
def test_vocab_ranges_partition_the_vocabulary(vocab, size, blocks):
    ranges = [tp.vocab_range(vocab, r) for r in _ranks(size)]
    assert [len(x) for x in ranges] == blocks and [i for x in ranges for i in x] == list(range(vocab))
    table = torch.randn(vocab, 2)
    assert torch.equal(torch.cat([tp.vocab_shard(table, r) for r in _ranks(size)]), table)


# ------------------------------------------------------------------------------------------------- gloo


def _check_rank(out: dict, rank: int, parallel: ParallelConfig) -> None:
    """One rank's outputs against the unsharded ops (its replica's seeds, as tp_modules shifts them)."""
    size, shift = parallel.tensor_parallel_size, 100 * (rank // parallel.tensor_parallel_size)
    r = tp.TPRank(rank % size, size)
    for case, full, sliced, counts in zip(CASES, out["full"], out["sliced"], out["counts"]):
        case = Case(case.seed + shift, case.shape, case.dtype, case.limit)
        ref = tp_workers.reference(case)
        for name, expect in ref.items():
            assert full[name].shape == expect.shape and full[name].dtype == expect.dtype, (case, name)
            torch.testing.assert_close(full[name], expect, **TOL[case.dtype], msg=f"{case} {name}")
        torch.testing.assert_close(full["column_local"], tp.split_units(ref["column"], -1, INTER, r, "y", "cols"),
                                   **TOL[case.dtype])
        ids = tp.vocab_range(VOCAB, r)
        torch.testing.assert_close(full["head_local"], ref["head"][..., ids.start:ids.stop], **TOL[case.dtype])
        for name in ("embed", "tiny_embed"):
            assert torch.equal(full[name], ref[name])  # one non-zero term per row: exact
        assert all(torch.equal(sliced[k], full[k]) for k in sliced), case  # same shards, same bits
        assert counts == COLLECTIVES, case  # an empty batch enters every collective too


def _run_world(parallel: ParallelConfig, timeout_s: float) -> None:
    with WorkerGroup(tp_workers.tp_modules, parallel, (CASES,), OPTIONS) as group:
        results = group.wait(timeout_s)
    for rank, out in enumerate(results):
        _check_rank(out, rank, parallel)
        size = parallel.tensor_parallel_size
        divisible, shards = out["errors"][:3], out["errors"][3:]
        assert [e.split(":")[0] for e in divisible] == ["wq_b", "wo_b", "shared_experts.gate"]
        assert all(f"not divisible by tensor-parallel size {size}" in e for e in divisible)
        assert shards[0].startswith(f"embedding shard has {VOCAB} rows, TP rank {rank % size} of {size} holds")
        assert shards[1].startswith(f"LM head shard has {VOCAB} rows")
        assert shards[2] == f"row-parallel input has {3 * size + 1} features, expected {size} x 3"


def test_world2_tp_modules_match_unsharded_ops():
    _run_world(ParallelConfig(1, 2), 90)


@pytest.mark.slow
def test_world4_tp4_modules_match_unsharded_ops():
    assert HEADS % 4 == 0 and GROUPS % 4 == 0 and INTER % 4 == 0
    _run_world(ParallelConfig(1, 4), 180)


@pytest.mark.slow
def test_world4_dp2_tp2_modules_stay_inside_their_tp_group():
    _run_world(ParallelConfig(2, 2), 180)
