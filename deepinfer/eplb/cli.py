"""`deepinfer eplb`: a placement computed offline from recorded expert load (eplb.stats files)."""

from __future__ import annotations

import argparse

import torch


def add_parser(commands) -> None:
    sub = commands.add_parser("eplb", help="compute an expert placement from recorded expert load (docs/eplb.md)")
    sub.add_argument("--stats", required=True, metavar="FILE",
                     help="expert-load file (LLM.expert_load, saved) or a saved /metrics scrape")
    sub.add_argument("--num-gpus", type=int, required=True, help="expert-parallel ranks")
    sub.add_argument("--num-nodes", type=int, default=1, help="server nodes (replicas stay inside one)")
    sub.add_argument("--num-groups", type=int, default=1, help="expert groups (packed whole onto nodes)")
    sub.add_argument("--num-redundant-experts", type=int, default=0, help="extra physical expert slots")
    sub.add_argument("--current", metavar="FILE", help="current placement: prefer moving fewer experts")
    sub.add_argument("--out", required=True, metavar="FILE", help="placement file to write")
    sub.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer.distributed.moe_comm import place_experts
    from deepinfer.eplb import policy
    from deepinfer.eplb.stats import layer_balancedness, load_expert_load

    load = load_expert_load(args.stats)
    slots = load.shape[1] + args.num_redundant_experts
    common = (load, slots, args.num_groups, args.num_nodes, args.num_gpus)
    if args.current:
        current = policy.load_placement(args.current, args.num_gpus, load.shape[1])
        phy2log, _, logcnt = policy.rebalance_experts_migration_aware(*common, current)
        print(f"moves {policy.moved_slots(current, phy2log)} expert slots from {args.current}")
    else:
        phy2log, _, logcnt = policy.rebalance_experts(*common)
    static = layer_balancedness(load, place_experts(load.shape[1], args.num_gpus).starts)
    print(f"balancedness: contiguous {sum(static) / len(static):.3f} -> placement "
          f"{policy.balancedness(load, phy2log, args.num_gpus, logcnt):.3f} ({slots} slots on {args.num_gpus} GPUs)")
    policy.save_placement(args.out, phy2log.to(torch.long), args.num_gpus)
    return 0
