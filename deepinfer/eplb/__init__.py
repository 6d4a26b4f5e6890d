"""Expert-parallel load balancing (EPLB): the placement policy as pure functions (policy.py). The engine does not
use it yet: no load statistics, redundant experts or live rebalancing are wired in."""

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
