"""WorkerGroup targets for test_tp.py (spawned workers import this module by name, like dist_workers.py).

Every rank and the parent build the same full weights and inputs from a seed; ranks run the TP modules of
deepinfer/distributed/tp.py over their TP group and return the outputs, the parent compares them with the
unsharded torch ops (`reference`)."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import deepinfer.distributed.backend as backend
import deepinfer.distributed.tp as tp
from deepinfer.layers.moe import swiglu

# Divisible by TP 1, 2 and 4, except VOCAB (37): the padded vocab split gets ragged blocks (19 + 18; 10 x 3 + 7).
HIDDEN, INTER, VOCAB, HEADS, HEAD_DIM, GROUPS, O_LORA = 16, 24, 37, 8, 4, 4, 6
TINY_VOCAB = 1  # fewer ids than ranks: ranks 1.. hold empty vocab blocks and still join every collective
GROUP_TIMEOUT_S = 30  # a collective that waits longer fails the rank instead of hanging the test


@dataclass(frozen=True)
class Case:
    seed: int
    shape: tuple[int, ...]  # leading dims of every input; (0,) is an empty batch
    dtype: torch.dtype = torch.float32
    limit: float = 0.0  # swiglu clamp (V4's shared experts use > 0)


def make_weights(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)
    return {"col_w": rand(INTER, HIDDEN), "col_b": rand(INTER), "row_w": rand(HIDDEN, INTER), "row_b": rand(HIDDEN),
            "embed": rand(VOCAB, HIDDEN), "head": rand(VOCAB, HIDDEN), "tiny": rand(TINY_VOCAB, HIDDEN),
            "gate": rand(INTER, HIDDEN), "up": rand(INTER, HIDDEN), "down": rand(HIDDEN, INTER),
            "wo_a": rand(GROUPS * O_LORA, HEADS * HEAD_DIM // GROUPS), "wo_b": rand(HIDDEN, GROUPS * O_LORA)}


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """x [..., HIDDEN], h [..., INTER], attention output [..., HEADS * HEAD_DIM], ids hitting every vocab block."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    n = int(torch.Size(case.shape).numel())
    ids = ((torch.arange(n) * 9 + case.seed) % VOCAB).view(case.shape)
    return {"x": torch.randn(*case.shape, HIDDEN, generator=g).to(case.dtype),
            "h": torch.randn(*case.shape, INTER, generator=g).to(case.dtype),
            "attn": torch.randn(*case.shape, HEADS * HEAD_DIM, generator=g).to(case.dtype), "ids": ids}


def grouped(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """V4's grouped wo_a: group g's rows of w [G * o_lora, H d / G] applied to group g's heads of x [..., H d]."""
    xs = x.reshape(-1, groups, w.shape[1]).transpose(0, 1)  # [G, N, H d / G]
    out = torch.bmm(xs, w.view(groups, -1, w.shape[1]).transpose(1, 2))  # [G, N, o_lora]
    return out.transpose(0, 1).reshape(*x.shape[:-1], groups * out.shape[-1])


def reference(case: Case) -> dict[str, torch.Tensor]:
    """The single-process ops the TP modules must match."""
    w, i = make_weights(case.seed, case.dtype), make_inputs(case)
    gate_up = torch.cat([F.linear(i["x"], w["gate"]), F.linear(i["x"], w["up"])], -1)
    return {"column": F.linear(i["x"], w["col_w"], w["col_b"]), "row": F.linear(i["h"], w["row_w"], w["row_b"]),
            "embed": F.embedding(i["ids"], w["embed"]), "head": F.linear(i["x"], w["head"]),
            "tiny_embed": F.embedding(torch.zeros_like(i["ids"]), w["tiny"]), "tiny_head": F.linear(i["x"], w["tiny"]),
            "mlp": F.linear(swiglu(gate_up, case.limit), w["down"]),
            "v4_out": F.linear(grouped(i["attn"], w["wo_a"], GROUPS), w["wo_b"])}


def _v4_output_projection(w: dict, attn: torch.Tensor, r: tp.TPRank, group) -> torch.Tensor:
    """V4 attention output under TP: local heads -> local wo_a groups -> row-parallel wo_b (one all-reduce)."""
    local_heads = tp.head_shard(attn, HEADS, r, "attn", dim=-1)
    wo_a = tp.group_shard(w["wo_a"], GROUPS, r, "wo_a")
    wo_b = tp.RowParallelLinear(tp.group_shard(w["wo_b"], GROUPS, r, "wo_b", dim=1), None, group)
    return wo_b(grouped(local_heads, wo_a, GROUPS // r.size))


def run_full(case: Case, group) -> dict[str, torch.Tensor]:
    """Every module built from the full weights (from_full)."""
    w, i, r = make_weights(case.seed, case.dtype), make_inputs(case), tp.TPRank.of(group)
    column = tp.ColumnParallelLinear.from_full(w["col_w"], w["col_b"], group, name="col_w")
    gathered = tp.ColumnParallelLinear.from_full(w["col_w"], w["col_b"], group, gather_output=True)
    row = tp.RowParallelLinear.from_full(w["row_w"], w["row_b"], group)
    full_input_row = tp.RowParallelLinear.from_full(w["row_w"], w["row_b"], group, input_is_parallel=False)
    return {"column_local": column(i["x"]), "column": gathered(i["x"]),
            "row": row(tp.split_units(i["h"], -1, INTER, r, "h", "features")),
            "row_full_input": full_input_row(i["h"]),
            "embed": tp.VocabParallelEmbedding.from_full(w["embed"], group)(i["ids"]),
            "head": tp.ParallelLMHead.from_full(w["head"], group)(i["x"]),
            "head_local": tp.ParallelLMHead.from_full(w["head"], group).local_logits(i["x"]),
            "tiny_embed": tp.VocabParallelEmbedding.from_full(w["tiny"], group)(torch.zeros_like(i["ids"])),
            "tiny_head": tp.ParallelLMHead.from_full(w["tiny"], group)(i["x"]),
            "mlp": tp.TPMLP.from_full(w["gate"], w["up"], w["down"], group, case.limit)(i["x"]),
            "v4_out": _v4_output_projection(w, i["attn"], r, group)}


def run_sliced(case: Case, group) -> dict[str, torch.Tensor]:
    """The same modules from pre-sliced weights, as the loader will hand them to a rank."""
    w, i, r = make_weights(case.seed, case.dtype), make_inputs(case), tp.TPRank.of(group)
    column = tp.ColumnParallelLinear(tp.column_shard(w["col_w"], r, "c"), tp.column_shard(w["col_b"], r, "b"),
                                     group, gather_output=True)
    row = tp.RowParallelLinear(tp.row_shard(w["row_w"], r, "r"), w["row_b"], group, input_is_parallel=False)
    mlp = tp.TPMLP.from_shards(tp.column_shard(w["gate"], r, "g"), tp.column_shard(w["up"], r, "u"),
                               tp.row_shard(w["down"], r, "d"), group, case.limit)
    return {"column": column(i["x"]), "row_full_input": row(i["h"]),
            "embed": tp.VocabParallelEmbedding(tp.vocab_shard(w["embed"], r), VOCAB, group)(i["ids"]),
            "head": tp.ParallelLMHead(tp.vocab_shard(w["head"], r), VOCAB, group)(i["x"]), "mlp": mlp(i["x"])}


@contextmanager
def counting_collectives():
    """Count the all_reduce / all_gather calls tp.py makes (they still run)."""
    counts, reduce, gather = Counter(), dist.all_reduce, tp._all_gather_single

    def counted(name, fn):
        return lambda *a, **k: (counts.update([name]), fn(*a, **k))[1]
    dist.all_reduce, tp._all_gather_single = counted("all_reduce", reduce), counted("all_gather", gather)
    try:
        yield counts
    finally:
        dist.all_reduce, tp._all_gather_single = reduce, gather


def shape_errors(group) -> list[str]:
    """Calls that must raise before any collective: sizes not divisible by the TP size, mis-sized shards."""
    size, errors = dist.get_world_size(group), []
    bad = torch.zeros(2 * size + 1, 2 * size + 1)
    row = tp.RowParallelLinear(torch.zeros(4, 3), None, group, input_is_parallel=False)
    for build in (lambda: tp.ColumnParallelLinear.from_full(bad, group=group, name="wq_b"),
                  lambda: tp.RowParallelLinear.from_full(bad, group=group, name="wo_b"),
                  lambda: tp.TPMLP.from_full(bad, bad, bad.T, group, name="shared_experts"),
                  lambda: tp.VocabParallelEmbedding(torch.zeros(VOCAB, 2), VOCAB, group),
                  lambda: tp.ParallelLMHead(torch.zeros(VOCAB, 2), VOCAB, group),
                  lambda: row(torch.zeros(2, 3 * size + 1))):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    return errors


def tp_modules(rank: int, layout, cases: list[Case]) -> dict:
    """All cases in sequence in one TP group; replica d (DP rank) uses seed + 100 d, so groups cannot mix."""
    group, shift = backend.build_groups(layout, GROUP_TIMEOUT_S).tp, 100 * layout.dp_rank(rank)
    out = {"full": [], "sliced": [], "counts": [], "errors": shape_errors(group)}
    for case in cases:
        case = Case(case.seed + shift, case.shape, case.dtype, case.limit)
        with counting_collectives() as counts:
            out["full"].append(run_full(case, group))
        out["counts"].append(dict(counts))
        out["sliced"].append(run_sliced(case, group))
    return out
