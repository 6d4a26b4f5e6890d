"""EPLB mechanisms: slot placements with replicas (moe_comm.ExpertPlacement), expert-weight moves
(distributed/expert_move.py), and expert-parallel dispatch under placements with replicas.

Multi-rank parts run in one spawned gloo group per world size (2 and 4): every rank moves expert weights coded
by their expert id through several placements, and runs routed experts under random replicated placements
with both comms; the parent checks the codes slot by slot and the outputs against single-process
routed_experts (bit-identical: a replica runs its expert's single-process GEMM shape, rows at their places).
"""

from __future__ import annotations

import pytest
import torch
from test_moe_comm import Case, make_data, reference, save_rank_results, spawn_group, token_rows

from deepinfer.distributed.expert_move import Transfer, move_plan, move_weights, moved_experts
from deepinfer.distributed.moe_comm import (
    AllGatherComm,
    AllToAllComm,
    ExpertPlacement,
    ep_routed_experts,
    place_experts,
)
from deepinfer.eplb import rebalance_experts

JOIN_TIMEOUT_S = 180


def placement(row, experts, ep):
    return ExpertPlacement.from_phy2log(row, experts, ep)


def random_rows(experts: int, slots: int, count: int, seed: int, ep: int) -> list[list[int]]:
    """Policy placements for random skewed loads: replicas, several of one expert on a rank, moved experts."""
    g = torch.Generator().manual_seed(seed)
    load = (torch.rand(count, experts, generator=g) ** 4 * 1000).round()
    return rebalance_experts(load, slots, 1, 1, ep)[0].tolist()


# ----------------------------------------------------------------------------------------- pure parts


def test_from_phy2log_and_identity():
    p = placement([0, 1, 2, 3], 4, 2)
    assert p.phy2log is None and p == place_experts(4, 2)
    q = placement([3, 0, 3, 1, 2, 3], 4, 2)
    assert q.starts == (0, 3, 6) and q.slot_experts == (3, 0, 3, 1, 2, 3)
    with pytest.raises(ValueError, match="split evenly"):
        placement([0, 1, 2], 3, 2)
    with pytest.raises(ValueError, match="at least one slot"):
        placement([0, 0, 1, 1], 3, 2)
    with pytest.raises(ValueError, match="identity placements"):
        q.local_experts(0)
    with pytest.raises(ValueError, match="never decrease"):
        ExpertPlacement(4, (0, 3, 2, 4))


def test_replicas_split_an_expert_into_even_chunks():
    """Expert 3 has 3 replicas (slots 0, 2, 5): its 7 rows of a round go 3 / 2 / 2 in position order."""
    q = placement([3, 0, 3, 1, 2, 3], 4, 2)
    ids = torch.full((7,), 3)
    plan = torch.tensor([0, 0, 0, 7])
    assert q.slot_of(ids, torch.arange(7), plan).tolist() == [0, 0, 0, 2, 2, 5, 5]


@pytest.mark.parametrize("seed", range(6))
def test_rows_from_matches_the_rows_slot_of_sends(seed):
    """What a rank expects from each source (rows_from, from the counts alone) is what slot_of sends it."""
    g = torch.Generator().manual_seed(seed)
    experts, ep = 6, 3
    row = random_rows(experts, 9, 1, seed, ep)[0]
    p = placement(row, experts, ep)
    counts = torch.randint(0, 5, (ep, experts), generator=g)
    counts[seed % ep] = 0  # an idle source
    plan = counts.sum(0)
    sent = torch.zeros(ep, ep, dtype=torch.long)  # [source, owner]
    for src in range(ep):
        first = (counts.cumsum(0) - counts)[src]
        for e in range(experts):
            pos = first[e] + torch.arange(int(counts[src, e]))
            owners = p.owner_of(p.slot_of(torch.full_like(pos, e), pos, plan))
            sent[src] += torch.bincount(owners, minlength=ep)
    for rank in range(ep):
        assert p.rows_from(rank, counts).tolist() == sent[:, rank].tolist()


def test_move_plan_copies_locally_and_receives_each_expert_once():
    old = place_experts(4, 2)  # rank 0: 0 1, rank 1: 2 3
    new = placement([2, 0, 2, 3, 1, 3], 4, 2)  # rank 0: 2 0 2, rank 1: 3 1 3
    plan = move_plan(old, new)
    assert plan == [Transfer(1, 0, 0, 0), Transfer(0, 0, 0, 1), Transfer(0, 0, 0, 2, from_new=True),
                    Transfer(1, 1, 1, 0), Transfer(0, 1, 1, 1), Transfer(1, 1, 1, 2)]
    assert moved_experts(plan) == 2
    assert moved_experts(move_plan(new, new)) == 0
    with pytest.raises(ValueError, match="different"):
        move_plan(place_experts(4, 2), place_experts(4, 4))


def test_move_plan_spreads_senders_over_replicas():
    old = placement([0, 1, 0, 2, 0, 3, 0, 1], 4, 4)  # expert 0 on every rank
    new = placement([1, 2, 3, 0, 2, 3, 1, 0], 4, 4)
    senders = {t.dst: t.src for t in move_plan(old, new) if t.src != t.dst}
    assert len(set(senders.values())) > 1


# ----------------------------------------------------------------------------------------- multi-rank


def coded(p: ExpertPlacement, rank: int, shape=(3, 2)) -> list[torch.Tensor]:
    """Stacked tensors whose slot i is filled with its expert's id (w13-like float, w2-like bf16)."""
    slots = p.local_slots(rank)
    ids = torch.tensor(p.slot_experts[slots.start:slots.stop], dtype=torch.float32)
    return [ids.view(-1, 1, 1).expand(-1, *shape).clone(), (ids.view(-1, 1) * 10).expand(-1, 4).bfloat16()]


def run_moves(rank: int, world: int) -> list[bool]:
    """Contiguous -> several policy placements (with replicas) -> contiguous: codes right after every move."""
    experts = 8
    rows = random_rows(experts, experts + world, 4, world, world)
    steps = [place_experts(experts, world)] + [placement(r, experts, world) for r in rows]
    steps.append(placement(list(range(experts)), experts, world))
    tensors, ok = coded(steps[0], rank), []
    for old, new in zip(steps, steps[1:]):
        tensors = move_weights(tensors, old, new, rank)
        ok.append(all(torch.equal(a, b) for a, b in zip(tensors, coded(new, rank))))
    return ok


def dispatch_cases(world: int) -> list[Case]:
    """4 + world experts (world extra slots split evenly): even, an idle rank, every token to expert 0 first
    (the per-expert GEMM path, the hot expert's rows split over replicas), and K = 3."""
    counts = [(5,) * world, (0,) + (9,) * (world - 1), (40,) + (3,) * (world - 1), (7,) * world]
    return [Case(f"r{i}", "alltoall", 4 + world, 3 if i == 3 else 2, c, seed=i, skewed=i == 2)
            for i, c in enumerate(counts)]


def dispatch_row(case: Case, ids: torch.Tensor, world: int) -> list[int]:
    """The policy's placement for the case's own routing: its hot experts get the extra slots."""
    load = torch.bincount(ids.flatten(), minlength=case.experts).unsqueeze(0)
    return rebalance_experts(load, case.experts + world, 1, 1, world)[0][0].tolist()


def run_replicated_dispatch(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Routed experts under random replicated placements, both comms."""
    out = {}
    for i, case in enumerate(dispatch_cases(world)):
        x, ids, weights, w13, w2 = make_data(case)
        for comm_cls in (AllToAllComm, AllGatherComm):
            row = dispatch_row(case, ids, world) if comm_cls is AllToAllComm else \
                random_rows(case.experts, case.experts + world, 1, 10 * i + world, world)[0]
            p = placement(row, case.experts, world)
            slots = p.local_slots(rank)
            mine = list(p.slot_experts[slots.start:slots.stop])
            got = ep_routed_experts(*(t[token_rows(case, rank)] for t in (x, ids, weights)), w13[mine], w2[mine], p,
                                    comm_cls(p, rank), case.limit)
            out[f"{case.name}-{comm_cls.name}"] = got
        perm = torch.randperm(case.experts, generator=torch.Generator().manual_seed(i)).tolist()
        p = placement(perm, case.experts, world)  # no replicas, experts moved: positions are not sent
        mine = perm[p.local_slots(rank).start:p.local_slots(rank).stop]
        out[f"{case.name}-perm"] = ep_routed_experts(*(t[token_rows(case, rank)] for t in (x, ids, weights)),
                                                     w13[mine], w2[mine], p, AllToAllComm(p, rank), case.limit)
    return out


def worker(rank: int, world: int, port: int, out_dir: str):
    save_rank_results(rank, world, port, out_dir,
                      lambda: {"moves": run_moves(rank, world), "dispatch": run_replicated_dispatch(rank, world)})


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moves_and_replicated_dispatch(world, tmp_path):
    results = spawn_group(world, None, tmp_path, worker, JOIN_TIMEOUT_S)
    for rank in range(world):
        assert results[rank]["moves"] and all(results[rank]["moves"]), (rank, results[rank]["moves"])
    for case in dispatch_cases(world):
        want = reference(case)
        if case.skewed:  # the hot expert is served by several replicas, each on part of its rows
            assert dispatch_row(case, make_data(case)[1], world).count(0) > 1
        for comm in ("alltoall", "allgather", "perm"):
            for rank in range(world):
                got, mine = results[rank]["dispatch"][f"{case.name}-{comm}"], want[token_rows(case, rank)]
                if comm == "allgather" and case.topk > 2:  # its cross-rank sum regroups a token's K terms
                    torch.testing.assert_close(got, mine, atol=1e-5, rtol=1e-5)
                else:
                    assert torch.equal(got, mine), (case, comm, rank)
