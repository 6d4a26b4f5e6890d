"""Moving routed-expert weights from one placement to another (EPLB), point to point into staging buffers.

``move_plan`` (pure) says where every slot of the new placement gets its weights:
- from a slot of the same rank that holds the expert now (a local copy);
- else from another rank that holds it now; a rank receives each expert at most once, and its further new
  slots of that expert copy the received one (``from_new``). Senders are spread over an expert's current
  replicas (the receiving rank picks replica ``rank % count``).

``move_weights`` (collective over the EP group) runs a plan for one layer's stacked tensors: every rank sends
each peer one packed buffer and receives one from each (``batch_isend_irecv``), into new tensors; the caller
swaps them in at a step boundary, so no MoE call ever sees a half-moved layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.distributed.moe_comm import ExpertPlacement, pack_rows, unpack_rows


@dataclass(frozen=True)
class Transfer:
    """New slot dst_slot of rank dst (a local index) gets the weights of local slot src_slot of rank src: of the
    old placement, or of the new one when from_new (a copy of a slot the same rank has just received)."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    from_new: bool = False


def _holders(placement: ExpertPlacement) -> dict[int, list[tuple[int, int]]]:
    """Every expert's (rank, local slot) list, in slot order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rank in range(placement.ep_size):
        slots = placement.local_slots(rank)
        for i, e in enumerate(placement.slot_experts[slots.start:slots.stop]):
            out.setdefault(e, []).append((rank, i))
    return out


def move_plan(old: ExpertPlacement, new: ExpertPlacement) -> list[Transfer]:
    """One Transfer per slot of `new`, by rank then slot (see the module docstring)."""
    if (old.num_experts, old.ep_size) != (new.num_experts, new.ep_size):
        raise ValueError("placements for different experts or ranks")
    holders, plan = _holders(old), []
    for rank in range(new.ep_size):
        slots = new.local_slots(rank)
        received: dict[int, int] = {}
        for i, e in enumerate(new.slot_experts[slots.start:slots.stop]):
            own = [s for r, s in holders[e] if r == rank]
            if own:
                plan.append(Transfer(rank, own[0], rank, i))
            elif e in received:
                plan.append(Transfer(rank, received[e], rank, i, from_new=True))
            else:
                src, src_slot = holders[e][rank % len(holders[e])]
                plan.append(Transfer(src, src_slot, rank, i))
                received[e] = i
    return plan


def moved_experts(plan: Sequence[Transfer]) -> int:
    """Expert weight copies that cross ranks."""
    return sum(t.src != t.dst for t in plan)


def move_weights(tensors: Sequence[torch.Tensor], old: ExpertPlacement, new: ExpertPlacement, rank: int,
                 group: dist.ProcessGroup | None = None, plan: Sequence[Transfer] | None = None) -> list[torch.Tensor]:
    """This rank's stacked tensors ([old local slots, ...] each) under `new` (collective over the EP group);
    plan: move_plan(old, new), when the caller has it already."""
    plan = move_plan(old, new) if plan is None else plan
    slots = len(new.local_slots(rank))
    out = [t.new_empty(slots, *t.shape[1:]) for t in tensors]
    for t in plan:
        if t.dst == rank and t.src == rank and not t.from_new:
            for dst, src in zip(out, tensors):
                dst[t.dst_slot] = src[t.src_slot]
    _exchange(plan, tensors, out, rank, group)
    for t in plan:
        if t.dst == rank and t.from_new:
            for dst in out:
                dst[t.dst_slot] = dst[t.src_slot]
    return out


def _exchange(plan: Sequence[Transfer], tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor], rank: int,
              group: dist.ProcessGroup | None) -> None:
    """The plan's cross-rank transfers: one packed buffer per (sender, receiver) pair, in plan order."""
    world = dist.get_world_size(group)
    sends = {p: [t for t in plan if t.src == rank and t.dst == p and p != rank] for p in range(world)}
    recvs = {p: [t for t in plan if t.dst == rank and t.src == p and p != rank and not t.from_new]
             for p in range(world)}
    layout = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
    row_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in layout)
    ops, inbox = [], {}
    for peer, items in sends.items():
        if items:
            buf = pack_rows(*[src[[t.src_slot for t in items]] for src in tensors])
            ops.append(dist.P2POp(dist.isend, buf, _global(group, peer), group))
    for peer, items in recvs.items():
        if items:
            inbox[peer] = torch.empty(len(items), row_bytes, dtype=torch.uint8, device=tensors[0].device)
            ops.append(dist.P2POp(dist.irecv, inbox[peer], _global(group, peer), group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for peer, buf in inbox.items():
        rows = [t.dst_slot for t in recvs[peer]]
        for dst, part in zip(out, unpack_rows(buf, layout)):
            dst[rows] = part


def _global(group: dist.ProcessGroup | None, peer: int) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)
