"""EPLB on a serving rank: the initial placement, live rebalancing and its bookkeeping (docs/eplb.md).

Every rank of the EP group holds one ExpertRebalancer and calls ``end_step`` at every step boundary
(ModelParallel.end_step). Invariants:
- Every decision is a function of collective results only (the all-reduced load window, the step count every
  rank shares), so every rank computes the same placements and runs the same moves in the same order.
- A layer's weights and its placement are swapped together, between steps: every MoE call of a step runs one
  consistent placement per layer, and every layer's outputs are the same under any placement (moe_comm).
- A rebalance moves at most `layers_per_step` layers per step boundary; serving goes on in between, each
  layer under its old placement until its own move is done. A newer rebalance replaces what is still queued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepinfer.config import EplbConfig
from deepinfer.distributed.expert_move import move_plan, move_weights, moved_experts
from deepinfer.distributed.moe_comm import ExpertPlacement
from deepinfer.eplb.policy import (
    load_placement,
    placement_balancedness,
    rebalance_experts,
    rebalance_experts_migration_aware,
)

logger = logging.getLogger("deepinfer.eplb")


@dataclass
class EplbCounters:
    """What a rank reports of EPLB (RankStats.eplb): the same on every rank of the group."""

    rebalances: int = 0  # placements computed and queued (layers whose balance would not improve stay)
    layers_moved: int = 0
    experts_moved: int = 0  # expert weight copies that crossed ranks, summed over the group
    move_seconds: float = 0.0  # this rank's wall time inside weight moves
    balancedness_before: list[float] = field(default_factory=list)  # per layer, at the last rebalance
    balancedness_after: list[float] = field(default_factory=list)  # per layer, of the placement it chose


class ExpertRebalancer:
    """One rank's EPLB driver over ModelParallel `mp`'s MoE layers (tags) and its lane-0 EP group."""

    def __init__(self, mp, config: EplbConfig):
        self.mp, self.config = mp, config
        self.steps, self.pending = 0, []  # pending: (tag, placement) moves not yet made, in order
        self.counters = EplbCounters()

    @property
    def num_slots(self) -> int:
        return self.mp.placement.num_experts + self.config.num_redundant_experts

    def start(self) -> None:
        """After loading (collective): move every layer from the contiguous block to its initial placement, the
        placement file's or, with redundant slots, the policy's for an even load; else stay contiguous."""
        ep, experts = self.mp.placement.ep_size, self.mp.placement.num_experts
        layers = len(self.mp.experts)
        if self.mp.comm_kind == "allgather" and self.mp.experts[0].topk > 2 and self.mp.ep_rank == 0:
            logger.warning("EPLB with --moe-comm allgather and top-%d routing: a placement change regroups the "
                           "cross-rank sum of a token's expert outputs (rounding-level changes); use alltoall for "
                           "outputs independent of the placement", self.mp.experts[0].topk)
        if self.num_slots % ep:
            raise ValueError(f"{experts} routed experts + {self.config.num_redundant_experts} redundant do not split "
                             f"evenly over {ep} expert-parallel ranks")
        if self.config.placement_file is not None:
            phy2log = load_placement(self.config.placement_file, num_gpus=ep, num_logical=experts)
            if phy2log.shape != (layers, self.num_slots):
                raise ValueError(f"{self.config.placement_file}: placement for {phy2log.shape[0]} layers x "
                                 f"{phy2log.shape[1]} slots; this engine has {layers} MoE layers x {self.num_slots} "
                                 f"slots ({experts} experts + {self.config.num_redundant_experts} redundant: set "
                                 f"num_redundant_experts to the file's extra slots)")
        elif self.config.num_redundant_experts:
            phy2log, _, _ = rebalance_experts(torch.ones(layers, experts), self.num_slots, 1, 1, ep)
        else:
            return
        self._warm_up_group()
        self.pending = [(tag, ExpertPlacement.from_phy2log(row.tolist(), experts, ep))
                        for tag, row in enumerate(phy2log)]
        self._move(len(self.pending))
        device = self.mp.experts[0].w13.device
        if device.type == "cuda":  # the contiguous blocks' freed memory back for the KV budget measured next
            torch.cuda.empty_cache()

    def _warm_up_group(self) -> None:
        """One collective on the experts' device before the first point-to-point batch: NCCL requires every
        rank in a group's first batch_isend_irecv, and a rank with nothing to move would skip it."""
        device = self.mp.experts[0].w13.device
        dist.all_reduce(torch.zeros(1, device=device), group=self.mp.ep_group)

    def end_step(self) -> None:
        """A step boundary (collective when it rebalances or moves): count it, maybe plan, move queued layers."""
        self.steps += 1
        if self.config.enabled and self.steps % self.config.step_interval == 0:
            self._plan()
        if self.pending:
            self._move(self.config.layers_per_step)

    def _plan(self) -> None:
        """Queue, per layer, the policy's placement for the window's load when it balances better. EP rank 0
        decides and broadcasts (float rounding may differ between machines; the moves must not)."""
        load = self._global_load()
        if not load.any():
            return
        ep, experts = self.mp.placement.ep_size, self.mp.placement.num_experts
        current = torch.tensor([e.placement.slot_experts for e in self.mp.experts])
        if current.shape[1] != self.num_slots:
            raise ValueError(f"layers hold {current.shape[1]} slots, EPLB plans {self.num_slots}")
        new, move = self._decide(load, current, ep)
        self.pending = [(tag, ExpertPlacement.from_phy2log(new[tag].tolist(), experts, ep))
                        for tag in range(len(move)) if move[tag]]
        before, after = placement_balancedness(load, current, ep), placement_balancedness(load, new, ep)
        chosen = [a if m else b for b, a, m in zip(before, after, move)]
        c = self.counters
        c.rebalances += 1
        c.balancedness_before, c.balancedness_after = before, chosen
        if self.mp.ep_rank == 0:  # every rank decides the same
            logger.info("EPLB rebalance %d at step %d: balancedness %.3f -> %.3f, %d of %d layers to move",
                        c.rebalances, self.steps, sum(before) / len(before), sum(chosen) / len(chosen),
                        len(self.pending), len(before))

    def _decide(self, load: torch.Tensor, current: torch.Tensor, ep: int) -> tuple[torch.Tensor, list[bool]]:
        """(new phy2log, whether each layer moves) as EP rank 0 computed them (collective broadcast)."""
        table = torch.zeros(current.shape[0], current.shape[1] + 1, dtype=torch.long)
        if self.mp.ep_rank == 0:
            new, _, _ = rebalance_experts_migration_aware(load, self.num_slots, 1, 1, ep, current)
            before, after = placement_balancedness(load, current, ep), placement_balancedness(load, new, ep)
            table[:, :-1] = new
            table[:, -1] = torch.tensor([a > b + 1e-9 for b, a in zip(before, after)])
        src = 0 if self.mp.ep_group is None else dist.get_global_rank(self.mp.ep_group, 0)
        dist.broadcast(table, src=src, group=self.mp.ep_group)
        return table[:, :-1], table[:, -1].bool().tolist()

    def _global_load(self) -> torch.Tensor:
        """[layers, experts] the window's load summed over the EP group (collective)."""
        load = self.mp.ensure_load().totals().cpu()
        dist.all_reduce(load, group=self.mp.ep_group)
        return load

    def _move(self, count: int) -> None:
        """Move and swap in the first `count` queued layers (collective), timing it."""
        start = time.perf_counter()
        batch, self.pending = self.pending[:count], self.pending[count:]
        for tag, placement in batch:
            experts = self.mp.experts[tag]
            plan = move_plan(experts.placement, placement)
            with torch.no_grad():
                w13, w2 = move_weights([experts.w13, experts.w2], experts.placement, placement, self.mp.ep_rank,
                                       self.mp.ep_group, plan)
            self.counters.experts_moved += moved_experts(plan)
            experts.swap(placement, w13, w2)
        self.counters.layers_moved += len(batch)
        if self.mp.experts[0].w13.device.type == "cuda":
            torch.cuda.synchronize()  # the copies are asynchronous: time them whole
        self.counters.move_seconds += time.perf_counter() - start
