"""Check a world end to end: `torchrun [--nnodes N --node-rank i --master-addr A --master-port P]
--nproc-per-node K -m deepinfer.distributed.check --tensor-parallel-size T [--expert-parallel]`.

Every rank joins from the torchrun environment, builds the groups and all-reduces its rank + 1 over the world,
its TP, DP and EP groups and the control group; each sum must equal the arithmetic. Rank 0 prints one line
starting with OK; any mismatch raises (non-zero exit). `verify_world` is also a WorkerGroup target.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from deepinfer.config import ParallelConfig
from deepinfer.distributed.backend import build_groups, data_device, init_from_env
from deepinfer.distributed.layout import RankLayout, Ranks, make_layout


def _check_sum(ranks: Ranks, group: dist.ProcessGroup | None, rank: int, device: torch.device) -> None:
    """All-reduce rank + 1 over `group` and compare with sum(r + 1 for r in ranks)."""
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t, group=group)
    expected = float(sum(r + 1 for r in ranks))
    if t.item() != expected:
        raise RuntimeError(f"rank {rank}: all_reduce over {list(ranks)} gave {t.item()}, expected {expected}")


def verify_world(rank: int, layout: RankLayout, timeout_s: float = 60.0) -> dict:
    """Collective over all ranks. Returns what this rank checked, for the caller to compare with the layout."""
    groups, device = build_groups(layout, timeout_s), data_device()
    world = tuple(range(layout.world_size))
    _check_sum(world, None, rank, device)
    _check_sum(layout.tp_group(rank), groups.tp, rank, device)
    _check_sum(layout.dp_group(rank), groups.dp, rank, device)
    if groups.ep is not None:
        _check_sum(layout.ep_group, groups.ep, rank, device)
    _check_sum(world, groups.control, rank, torch.device("cpu"))
    return {"rank": rank, "dp_rank": layout.dp_rank(rank), "tp_rank": layout.tp_rank(rank),
            "tp_group": dist.get_process_group_ranks(groups.tp), "dp_group": dist.get_process_group_ranks(groups.dp),
            "ep_group": None if groups.ep is None else dist.get_process_group_ranks(groups.ep)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    env = init_from_env(args.timeout_s)
    if env.world_size % args.tensor_parallel_size:
        raise ValueError(f"world size {env.world_size} is not a multiple of --tensor-parallel-size")
    parallel = ParallelConfig(env.world_size // args.tensor_parallel_size, args.tensor_parallel_size,
                              args.expert_parallel)
    info = verify_world(env.rank, make_layout(parallel, env.world_size), args.timeout_s)
    dist.barrier()
    if env.rank == 0:
        print(f"OK world={env.world_size} dp={parallel.data_parallel_size} tp={parallel.tensor_parallel_size} "
              f"backend={dist.get_backend()} rank0={info}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
