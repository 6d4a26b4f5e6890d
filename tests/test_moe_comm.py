"""Expert-parallel dispatch/combine (deepinfer/distributed/moe_comm.py) against single-process routed_experts.

Distributed cases run in one spawned gloo group per world size on loopback: every case runs in sequence in
the same group (so token counts change from call to call, idle ranks included, as in a DP+EP step loop),
each rank saves its outputs, and the parent compares them with routed_experts over the full weights.

Exactness (fp32 and bf16 alike). ep_routed_experts shapes each rank's expert GEMMs by the global expert counts
(the single-process plan), so expert outputs carry routed_experts' bits; what remains is the order of the K
terms of a token. LocalComm and AllToAllComm add them in routed_experts' order and dtype: bit-identical for
every K. AllGatherComm sums per-rank partials across ranks: exact when at most two non-zero terms meet
(K <= 2, any world size), regrouped for K = 3 (within 1e-5 in fp32, 2e-2 in bf16).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepinfer.distributed.moe_comm import (
    AllGatherComm,
    AllToAllComm,
    LocalComm,
    as_bytes,
    bytes_moved,
    ep_routed_experts,
    from_bytes,
    pack_rows,
    place_experts,
    unpack_rows,
)
from deepinfer.layers.moe import routed_experts

GROUP_TIMEOUT_S = 30  # a collective that waits longer fails the rank instead of hanging the test
JOIN_TIMEOUT_S = 120
HIDDEN, INTER = 32, 16


@dataclass(frozen=True)
class Case:
    name: str
    comm: str  # "allgather", "allgather_rs" (reduce_scatter_tensor), "alltoall"
    experts: int
    topk: int
    counts: tuple[int, ...]  # tokens per rank
    dtype: torch.dtype = torch.float32
    limit: float = 0.0
    seed: int = 0
    skewed: bool = False  # every token picks expert 0: routed_experts takes its per-expert loop, not the bmm


def make_data(case: Case):
    """Full-batch inputs and full weights of a case; every rank and the parent build the same tensors."""
    g = torch.Generator().manual_seed(case.seed)
    total = sum(case.counts)
    x = torch.randn(total, HIDDEN, generator=g)
    scores = torch.rand(total, case.experts, generator=g)
    if case.skewed:
        scores[:, 0] = -1.0
    ids = scores.argsort(dim=1)[:, :case.topk]  # distinct per token
    weights = torch.rand(total, case.topk, generator=g)
    w13 = torch.randn(case.experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(case.experts, HIDDEN, INTER, generator=g) / INTER ** 0.5
    return x.to(case.dtype), ids, weights, w13.to(case.dtype), w2.to(case.dtype)


def token_rows(case: Case, rank: int) -> slice:
    start = sum(case.counts[:rank])
    return slice(start, start + case.counts[rank])


def build_comm(kind: str, placement, rank: int):
    if kind == "allgather_rs":
        return AllGatherComm(placement, rank, reduce="reduce_scatter")
    return {"allgather": AllGatherComm, "alltoall": AllToAllComm}[kind](placement, rank)


def run_case(case: Case, rank: int, world: int):
    """This rank's EP output of case, the bytes its comm handed to collectives, and the stand-in output."""
    x, ids, weights, w13, w2 = make_data(case)
    placement = place_experts(case.experts, world)
    comm = build_comm(case.comm, placement, rank)
    mine, local = token_rows(case, rank), placement.local_experts(rank)
    out = ep_routed_experts(x[mine], ids[mine], weights[mine], w13[local.start:local.stop],
                            w2[local.start:local.stop], placement, comm, case.limit)
    return out, comm.payload_bytes


def run_fp8_dispatch(rank: int, world: int):
    """AllToAllComm.dispatch of float8 rows: what rank 0 receives for its experts, as raw bytes."""
    case = Case("fp8", "alltoall", experts=4, topk=2, counts=(3, 2))
    x, ids, weights, *_ = make_data(case)
    comm = AllToAllComm(place_experts(case.experts, world), rank)
    mine = token_rows(case, rank)
    work = comm.dispatch(x[mine].to(torch.float8_e4m3fn), ids[mine], weights[mine])
    return work.x.view(torch.uint8), work.expert_ids


def rejects_wrong_world(rank: int) -> bool:
    try:
        AllToAllComm(place_experts(6, 3), rank)
    except ValueError:
        return True
    return False


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[Case]):
    save_rank_results(rank, world, port, out_dir, lambda: run_cases(cases, rank, world))


def run_cases(cases: list[Case], rank: int, world: int) -> dict:
    results = {case.name: run_case(case, rank, world) for case in cases}
    if world == 2:
        results["fp8"] = run_fp8_dispatch(rank, world)
        results["wrong_world"] = rejects_wrong_world(rank)
    return results


def save_rank_results(rank: int, world: int, port: int, out_dir: str, compute) -> None:
    """A spawned rank: join the loopback gloo group, save compute()'s results (or the traceback) for the parent."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        torch.save(compute(), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_group(world: int, cases: list[Case] | None, out_dir, target=None, join_timeout_s: float = JOIN_TIMEOUT_S
                ) -> list[dict]:
    """Run target (default worker) as target(rank, world, port, out_dir[, cases]) on world spawned ranks over
    loopback gloo; every rank's saved results, or fail with its error."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    extra = () if cases is None else (cases,)
    procs = [ctx.Process(target=target or worker, args=(r, world, port, str(out_dir), *extra)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(join_timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [(out_dir / f"rank{r}.err") for r in range(world) if (out_dir / f"rank{r}.err").exists()]
    assert not errors, "\n".join(e.read_text() for e in errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def reference(case: Case) -> torch.Tensor:
    """Single-process routed_experts with the ranks' one intra-op thread: the GEMM kernels (and so the last
    bits of their results) depend on the thread count."""
    x, ids, weights, w13, w2 = make_data(case)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return routed_experts(x, ids, weights, w13, w2, case.limit)
    finally:
        torch.set_num_threads(threads)


def cases_for(world: int) -> list[Case]:
    """Ragged counts, an idle rank, all idle, E not divisible by world, K = 2 and 3, bf16, V4's clamp, and
    skewed routing (both of routed_experts' GEMM plans)."""
    idle_first = (0,) + tuple(range(5, 5 + 2 * (world - 1), 2))
    ragged = tuple(range(3, 3 + 4 * world, 4))
    out = []
    for comm in ("allgather", "allgather_rs", "alltoall"):
        for topk in (2, 3):
            out.append(Case(f"{comm}-k{topk}-idle", comm, 5, topk, idle_first, seed=topk))
            out.append(Case(f"{comm}-k{topk}-ragged", comm, 5, topk, ragged, seed=10 + topk))
        out.append(Case(f"{comm}-bf16-k2", comm, 5, 2, ragged, dtype=torch.bfloat16, seed=20))
        out.append(Case(f"{comm}-bf16-k3", comm, 5, 3, ragged[::-1], dtype=torch.bfloat16, seed=21))
        out.append(Case(f"{comm}-limit", comm, 7, 3, ragged, limit=0.5, seed=30))
        out.append(Case(f"{comm}-all-idle", comm, 5, 2, (0,) * world, seed=40))
        out.append(Case(f"{comm}-skewed", comm, 7, 2, idle_first, seed=60, skewed=True))
    return out


def same_order(case: Case) -> bool:
    """Where the EP sum adds a token's terms in routed_experts' order (see the module docstring)."""
    return case.comm == "alltoall" or case.topk <= 2


def assert_near(out: torch.Tensor, want: torch.Tensor, case: Case, rank: int):
    assert out.shape == want.shape and out.dtype == want.dtype, (case, rank)
    tol = 1e-5 if case.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=lambda m: f"{case} rank {rank}: {m}")


def check_outputs(world: int, cases: list[Case], results: list[dict]):
    for case in cases:
        ref = reference(case)
        for rank in range(world):
            out, _ = results[rank][case.name]
            want = ref[token_rows(case, rank)]
            if same_order(case):
                assert out.dtype == want.dtype and torch.equal(out, want), (case, rank, (out - want).abs().max())
            else:
                assert_near(out, want, case, rank)


def check_bytes(world: int, cases: list[Case], results: list[dict]):
    for case in cases:
        delivered = sum(results[rank][case.name][1] for rank in range(world))
        kind = case.comm.removesuffix("_rs")
        elem = torch.empty(0, dtype=case.dtype).element_size()
        assert delivered == bytes_moved(kind, case.counts, HIDDEN, case.topk, world, elem, case.experts), case


# ----------------------------------------------------------------------------------------- world 2


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = cases_for(2)
    return cases, spawn_group(2, cases, tmp_path_factory.mktemp("ep2"))


def test_world2_matches_routed_experts(world2):
    check_outputs(2, *world2)


def test_world2_bytes_moved_match_the_tensors_delivered(world2):
    check_bytes(2, *world2)


def test_world2_comm_rejects_a_placement_for_another_world(world2):
    assert all(results["wrong_world"] for results in world2[1])


def test_world2_fp8_rows_travel_as_bytes(world2):
    """Rank 0 owns experts 0 and 1; it receives exactly the fp8 bytes of the pairs routed there."""
    case = Case("fp8", "alltoall", experts=4, topk=2, counts=(3, 2))
    x, ids, *_ = make_data(case)
    x8 = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got_rows, got_ids = world2[1][0]["fp8"]
    want = sorted((int(ids[t, k]), src, t) for src in range(2) for t in range(*token_rows(case, src).indices(5))
                  for k in range(2) if ids[t, k] < 2)  # by local expert, then source rank, then token
    assert got_ids.tolist() == [e for e, _, _ in want]
    assert torch.equal(got_rows, x8[[t for _, _, t in want]])


# ----------------------------------------------------------------------------------------- world 4


@pytest.mark.slow
def test_world4_matches_routed_experts_and_bytes(tmp_path):
    """4 ranks (oversubscribes 2 cores): E = 5 gives blocks 2, 1, 1, 1; E = 3 leaves rank 3 expertless."""
    cases = cases_for(4) + [Case("alltoall-e3", "alltoall", 3, 2, (2, 0, 5, 3), seed=50),
                            Case("allgather-e3", "allgather", 3, 2, (2, 0, 5, 3), seed=51)]
    results = spawn_group(4, cases, tmp_path)
    check_outputs(4, cases, results)
    check_bytes(4, cases, results)


# ----------------------------------------------------------------------------------------- single process


@pytest.mark.parametrize("experts,ep_size,sizes", [(8, 2, [4, 4]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]),
                                                   (3, 4, [1, 1, 1, 0]), (1, 1, [1])])
def test_placement_blocks(experts, ep_size, sizes):
    placement = place_experts(experts, ep_size)
    assert [len(placement.local_experts(r)) for r in range(ep_size)] == sizes
    flat = [e for r in range(ep_size) for e in placement.local_experts(r)]
    assert flat == list(range(experts))  # contiguous, in rank order, each expert once
    owners = [placement.owner(e) for e in range(experts)]
    assert placement.owner_of(torch.arange(experts)).tolist() == owners
    assert all(e in placement.local_experts(owners[e]) for e in range(experts))
    local = placement.local_index(torch.arange(experts)).tolist()
    assert local == [placement.local_experts(owners[e]).index(e) for e in range(experts)]


@pytest.mark.parametrize("experts,ep_size", [(0, 2), (4, 0)])
def test_placement_rejects_empty(experts, ep_size):
    with pytest.raises(ValueError):
        place_experts(experts, ep_size)


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_local_comm_is_routed_experts(topk):
    case = Case("local", "local", 6, topk, (9,), seed=topk)
    x, ids, weights, w13, w2 = make_data(case)
    placement = place_experts(6, 1)
    out = ep_routed_experts(x, ids, weights, w13, w2, placement, LocalComm(placement))
    assert torch.equal(out, routed_experts(x, ids, weights, w13, w2))


def test_ep_routed_experts_rejects_wrong_shard():
    placement = place_experts(4, 1)
    x, ids, weights, w13, w2 = make_data(Case("bad", "local", 4, 2, (3,)))
    with pytest.raises(ValueError, match="owns 4 expert slots"):
        ep_routed_experts(x, ids, weights, w13[:2], w2[:2], placement, LocalComm(placement))
    with pytest.raises(ValueError, match="another placement"):
        ep_routed_experts(x, ids, weights, w13, w2, placement, LocalComm(place_experts(5, 1)))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.int64])
def test_byte_views_round_trip(dtype):
    t = (torch.randn(5, 3, 2) * 4).to(dtype)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.shape == (5, 6 * t.element_size())
    assert torch.equal(from_bytes(b, dtype, (3, 2)).view(torch.uint8), t.view(torch.uint8))


def test_pack_rows_round_trip_and_empty():
    ids, x = torch.arange(8, dtype=torch.int32).reshape(4, 2), torch.randn(4, 3).to(torch.float8_e4m3fn)
    got_ids, got_x = unpack_rows(pack_rows(ids, x), [(torch.int32, (2,)), (x.dtype, (3,))])
    assert torch.equal(got_ids, ids) and torch.equal(got_x.view(torch.uint8), x.view(torch.uint8))
    empty = pack_rows(ids[:0], x[:0])
    assert empty.shape == (0, 11)
    assert [t.shape for t in unpack_rows(empty, [(torch.int32, (2,)), (x.dtype, (3,))])] == [(0, 2), (0, 3)]


def test_bytes_moved_formulas():
    # allgather: pads to the max count (7); alltoall: only real pairs travel, twice (there and back)
    assert bytes_moved("allgather", [7, 0], 4, 2, 2, 2, 5) == 2 * 2 * (24 + 7 * (8 + 16) + 7 * 8)
    assert bytes_moved("alltoall", [7, 0], 4, 2, 2, 2, 5) == 2 * 2 * 6 * 8 + 7 * 2 * (16 + 4)
    assert bytes_moved("alltoall", [7, 0], 4, 2, 2, 2, 5, replicas=True) == 2 * 2 * 6 * 8 + 7 * 2 * (16 + 8)
    assert bytes_moved("alltoall", 3, 4, 2, 2, 2, 5) == bytes_moved("alltoall", [3, 3], 4, 2, 2, 2, 5)
    assert bytes_moved("local", 5, 4, 2, 1, 2, 5) == 0
    with pytest.raises(ValueError):
        bytes_moved("alltoall", [1, 2, 3], 4, 2, 2, 2, 5)
