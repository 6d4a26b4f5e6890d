"""Balancedness of expert placements on a synthetic skewed load: the static contiguous placement vs the EPLB
policy (deepinfer/eplb) with 0 and num_gpus (and 2 * num_gpus) redundant slots, hierarchical and global, plus the
expert weights each placement moves away from the static one (plain vs migration-aware). CPU only, seconds.

Loads: per layer, `tokens` top-k routed tokens sampled over the experts with zipf(s) probabilities on a random
ranking. Writes benchmarks/results/eplb_policy.json.

    python benchmarks/eplb_policy.py [--experts 64] [--gpus 8] [--nodes 2] [--groups 8] [--zipf 1.2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.eplb import balancedness, moved_slots, rebalance_experts, rebalance_experts_migration_aware

RESULTS = Path(__file__).parent / "results"


def skewed_loads(layers: int, experts: int, s: float, tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """[layers, experts] routed-token counts: each token picks top_k distinct experts with zipf(s) probabilities."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(layers, experts, dtype=torch.long)
    for layer in range(layers):
        probs = (torch.randperm(experts, generator=g) + 1).double() ** -s
        picks = torch.multinomial(probs.expand(tokens, -1), top_k, generator=g)
        out[layer] = torch.bincount(picks.flatten(), minlength=experts)
    return out


def row(name: str, weight: torch.Tensor, phy2log: torch.Tensor, gpus: int, static: torch.Tensor | None,
        aware: torch.Tensor | None = None) -> dict:
    logcnt = torch.zeros_like(weight).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    out = {"placement": name, "slots": phy2log.shape[1], "balancedness": balancedness(weight, phy2log, gpus, logcnt)}
    if static is not None and static.shape == phy2log.shape:
        out["moved_from_static"] = moved_slots(static, phy2log)
        if aware is not None:
            out["moved_from_static_migration_aware"] = moved_slots(static, aware)
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    weight = skewed_loads(args.layers, args.experts, args.zipf, args.tokens, args.top_k, args.seed)
    static = torch.arange(args.experts).repeat(args.layers, 1)
    rows = [row("static contiguous", weight, static, args.gpus, static)]
    for groups, mode in ((args.groups, "hierarchical"), (1, "global")):
        for redundant in (0, args.gpus, 2 * args.gpus):
            slots = args.experts + redundant
            phy2log, _, _ = rebalance_experts(weight, slots, groups, args.nodes, args.gpus)
            aware = None
            if redundant == 0:
                aware, _, _ = rebalance_experts_migration_aware(weight, slots, groups, args.nodes, args.gpus, static)
            rows.append(row(f"policy {mode}, +{redundant} redundant", weight, phy2log, args.gpus, static, aware))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("layers", 16), ("experts", 64), ("gpus", 8), ("nodes", 2), ("groups", 8),
                          ("tokens", 8192), ("top-k", 8), ("seed", 0)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--zipf", type=float, default=1.2)
    args = parser.parse_args()
    rows = measure(args)
    for r in rows:
        moved = f"  moved {r['moved_from_static']}" if "moved_from_static" in r else ""
        aware = r.get("moved_from_static_migration_aware")
        aware = "" if aware is None else f" (migration-aware {aware})"
        print(f"{r['placement']:<36} slots {r['slots']:>3}  balancedness {r['balancedness']:.4f}{moved}{aware}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "eplb_policy.json").write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
