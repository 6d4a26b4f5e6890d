"""Expert-parallel load balancing (EPLB): the placement policy as pure functions (policy.py), expert-load
statistics (stats.py), `deepinfer eplb` (cli.py). The mechanisms live next to the tensors: serving a placement
with replicas in distributed/moe_comm.py, weight moves in distributed/expert_move.py, live rebalancing in
distributed/eplb_runtime.py (docs/eplb.md)."""

from deepinfer.eplb.policy import (
    Topology,
    balancedness,
    gpu_loads,
    load_placement,
    moved_slots,
    placement_balancedness,
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
    "placement_balancedness",
    "rebalance_experts",
    "rebalance_experts_migration_aware",
    "save_placement",
    "validate_placement",
]
