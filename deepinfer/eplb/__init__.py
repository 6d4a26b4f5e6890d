"""Expert-parallel load balancing (EPLB): the placement policy as pure functions (policy.py), expert-load
statistics (stats.py), `deepinfer eplb` (cli.py). Serving with a computed placement, redundant experts and live
rebalancing are not wired in yet (docs/eplb.md)."""

from deepinfer.eplb.policy import (
    Topology,
    balancedness,
    gpu_loads,
    load_placement,
    moved_slots,
    rebalance_experts,
    rebalance_experts_migration_aware,
    save_placement,
    validate_placement,
)

__all__ = [
    "Topology",
    "balancedness",
    "gpu_loads",
    "load_placement",
    "moved_slots",
    "rebalance_experts",
    "rebalance_experts_migration_aware",
    "save_placement",
    "validate_placement",
]
