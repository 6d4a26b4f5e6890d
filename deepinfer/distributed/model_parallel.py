"""What a model needs to know about the ranks it runs on, and the routed-expert layer built on it.

A model takes one ``ModelParallel`` (``ModelParallel.single()`` for one process) and builds its layers from it:
attention heads and dense projections split over the TP group (``distributed/tp.py``), routed experts either
sharded over the EP group (expert parallelism: whole experts per rank) or, without EP, split over the TP group
along the intermediate dimension like a dense MLP.

Invariants:
- ``ParallelExperts.forward`` returns the complete routed sum for every row it was given, on every TP rank of
  the replica (the replica's ranks hold the same hidden states).
- With EP, every MoE layer registers a tag (its order of construction, the same on every rank). A rank whose
  step makes fewer MoE calls than a peer's (an idle DP replica, a replica that drafts less) calls
  ``finish_step``, which joins the remaining rounds with empty batches (``MoEComm.drain``): every rank calls it
  at the end of every step, so the EP collectives always pair up.
- With EP and TP > 1, each TP rank dispatches a contiguous 1/T block of the replica's rows (padded to
  ceil(N / T) for the gather), so no (token, expert) pair is computed twice.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.distributed.backend import ParallelGroups
from deepinfer.distributed.moe_comm import (
    AllGatherComm,
    AllToAllComm,
    ExpertPlacement,
    LocalComm,
    LocalWork,
    MoEComm,
    _all_gather_single,
    _local_expert_outputs,
    place_experts,
)
from deepinfer.distributed.tp import TPRank, all_reduce
from deepinfer.eplb.stats import ExpertLoad
from deepinfer.layers.moe import ExpertQuant, routed_experts
from deepinfer.layers.quant_linear import _keep_dtype
from deepinfer.models.loader import FP4_GROUP

COMM_KINDS = {"allgather": AllGatherComm, "alltoall": AllToAllComm}


class ModelParallel:
    """A rank's place in the model's parallel layout (a runtime handle, not a config: it holds process groups)."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, tp_group: dist.ProcessGroup | None = None,
                 placement: ExpertPlacement | None = None, ep_rank: int = 0,
                 ep_group: dist.ProcessGroup | None = None, comm_kind: str = "allgather",
                 lane_groups: tuple[dist.ProcessGroup, ...] = ()):
        if comm_kind not in COMM_KINDS:
            raise ValueError(f"unknown MoE comm {comm_kind!r}; choose one of {sorted(COMM_KINDS)}")
        self.tp = TPRank(tp_rank, tp_size)
        self.tp_group, self.placement, self.ep_rank, self.ep_group = tp_group, placement, ep_rank, ep_group
        self.comm_kind = comm_kind
        # Lane k (two-batch overlap runs two, on two threads) has its own EP group and comm, so the lanes'
        # collectives never interleave on one group; lane 0 is the EP group itself.
        self.lane_groups = (ep_group, *lane_groups)
        self._comms: dict[int, MoEComm] = {}
        self._lane = threading.local()
        self._experts: list[ParallelExperts] = []  # by tag
        self.load_window, self.load = 0, None  # eplb.stats.ExpertLoad, created by the first recorded call
        self._load_lock = threading.Lock()  # two-batch overlap records from two threads
        self._two_lanes = False  # two-batch overlap: TwoBatchForward ends each step after both lanes
        self.rebalancer = None  # distributed.eplb_runtime.ExpertRebalancer, when EPLB serves this rank

    @classmethod
    def single(cls) -> ModelParallel:
        return cls()

    @classmethod
    def from_groups(cls, groups: ParallelGroups, num_experts: int, comm_kind: str = "allgather",
                    load_window: int = 0) -> ModelParallel:
        """This rank's handle in a world whose groups backend.build_groups made (collective-free); with EP and
        load_window > 0 it records the expert load of its tokens over that many steps (eplb.stats)."""
        layout, rank = groups.layout, groups.rank
        placement = None
        if layout.ep_group is not None:
            placement = place_experts(num_experts, len(layout.ep_group))
        mp = cls(layout.tp_rank(rank), layout.parallel.tensor_parallel_size, groups.tp, placement,
                 layout.ep_rank(rank) or 0, groups.ep, comm_kind, groups.ep_lanes)
        mp.load_window = load_window if placement is not None else 0
        return mp

    @property
    def is_single(self) -> bool:
        return self.tp.size == 1 and self.placement is None

    @property
    def expert_parallel(self) -> bool:
        return self.placement is not None

    @property
    def lane(self) -> int:
        return getattr(self._lane, "index", 0)

    @contextlib.contextmanager
    def in_lane(self, index: int):
        """This thread's MoE calls use lane `index`'s group and comm until the block ends."""
        if not 0 <= index < len(self.lane_groups):
            raise ValueError(f"lane {index} does not exist ({len(self.lane_groups)} EP lane groups)")
        previous, self._lane.index = self.lane, index
        try:
            yield
        finally:
            self._lane.index = previous

    @property
    def comm(self) -> MoEComm:
        """The dispatch/combine instance every MoE layer of the model shares, for this thread's lane."""
        lane = self.lane
        if lane not in self._comms:
            if self.placement is None:
                self._comms[lane] = LocalComm(place_experts(1, 1))
            else:
                comm = COMM_KINDS[self.comm_kind](self.placement, self.ep_rank, self.lane_groups[lane])
                comm.placement_for = self.layer_placement
                self._comms[lane] = comm
        return self._comms[lane]

    def layer_placement(self, tag: int) -> ExpertPlacement:
        """The expert placement MoE layer `tag` runs under now (EPLB swaps it at step boundaries)."""
        return self._experts[tag].placement

    @property
    def experts(self) -> tuple[ParallelExperts, ...]:
        """Every MoE layer's routed experts, by tag."""
        return tuple(self._experts)

    @property
    def moe_payload_bytes(self) -> int:
        """Bytes the EP collectives of every lane delivered to this rank."""
        return sum(comm.payload_bytes for comm in self._comms.values())

    def register(self, experts: ParallelExperts) -> int:
        self._experts.append(experts)
        return len(self._experts) - 1

    def record_load(self, tag: int, expert_ids: torch.Tensor) -> None:
        """Count the routing of this rank's own tokens in MoE layer `tag` (a no-op without a load window)."""
        if not self.load_window:
            return
        with self._load_lock:
            self.ensure_load(expert_ids.device).record(tag, expert_ids)

    def ensure_load(self, device: torch.device | str | None = None) -> ExpertLoad:
        """The load window, created on first use (on the experts' device; EP with load_window > 0 only)."""
        if self.load is None:
            device = device if device is not None else self._experts[0].w13.device
            self.load = ExpertLoad(len(self._experts), self.placement.num_experts, self.load_window, device)
        return self.load

    def finish_step(self) -> int:
        """End of a lane's step (collective over this lane's EP group): join peers' remaining MoE calls. Returns
        the rounds joined; 0 without EP (TP-only ranks never wait on another replica). A rank's single-lane
        step also ends the step (end_step); with two lanes the caller ends it once both lanes finished."""
        if self.placement is None or not self._experts:
            return 0
        first = self._experts[0]
        joined = self.comm.drain(self._drained_round, first.dim, first.topk, first.w13.dtype, first.w13.device)
        if not self._two_lanes:
            self.end_step()
        return joined

    def end_step(self) -> None:
        """Every rank ends every step here, with no MoE call in flight: one shared step count for the load window,
        and the step boundary where EPLB moves and swaps expert weights (collective over the EP group)."""
        if self.load is not None:
            self.load.end_step()
        if self.rebalancer is not None:
            self.rebalancer.end_step()

    def _drained_round(self, work: LocalWork) -> torch.Tensor:
        return self._experts[work.tag].local_outputs(work)


class ParallelExperts(nn.Module):
    """One MoE layer's routed experts as this rank holds them: parameters w13 [E_local, 2 I_local, D] (gate rows
    then up rows) and w2 [E_local, D, I_local], in the single-process layout of ``layers.moe``.

    EP: E_local = the experts ``placement`` gives this rank, I_local = I. Otherwise E_local = E and I_local =
    I / T (the gate and up halves are each split by rows, w2 by columns; partial sums are all-reduced).

    Kept quantised (``keep_quantized``, one process only): w13 / w2 hold the checkpoint's codes in the layouts of
    kernels/fused_moe.py, with w13_scale / w2_scale beside them; each carries ``expert_quant`` (layers.moe), and
    every tensor keeps its dtype through ``.to(dtype)`` (only device moves apply)."""

    def __init__(self, num_experts: int, dim: int, inter: int, topk: int, mp: ModelParallel, limit: float = 0.0):
        super().__init__()
        self.mp, self.num_experts, self.dim, self.topk, self.limit = mp, num_experts, dim, topk, limit
        if mp.expert_parallel:
            if mp.placement.num_experts != num_experts:
                raise ValueError(f"expert placement is for {mp.placement.num_experts} experts, layer has {num_experts}")
            self.placement = mp.placement  # this layer's own from here on (EPLB swaps it, with the weights)
            self.local = mp.placement.local_experts(mp.ep_rank)  # what loading fills: the contiguous block
            local_inter = inter
        else:
            if inter % mp.tp.size:
                raise ValueError(f"moe_intermediate_size {inter} is not divisible by tensor-parallel size "
                                 f"{mp.tp.size} (enable expert parallelism to keep experts whole)")
            self.placement, self.local, local_inter = None, range(num_experts), inter // mp.tp.size
        self.w13 = nn.Parameter(torch.zeros(len(self.local), 2 * local_inter, dim))
        self.w2 = nn.Parameter(torch.zeros(len(self.local), dim, local_inter))
        self.tag = mp.register(self) if mp.expert_parallel else 0
        self.rows_served = 0  # EP: (token, k) rows this rank's slots computed, all rounds (drained ones too)
        self.quant: str | None = None  # "fp8" | "mxfp4" (keep_quantized) | "int4" (keep_int4) once stored quantised

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_k weight_k * expert_{id_k}(x) for every row of x [N, D] (global ids [N, K])."""
        mp = self.mp
        if not mp.expert_parallel:
            out = routed_experts(x, topk_ids, topk_weights, self.w13, self.w2, self.limit)
            return all_reduce(out, mp.tp_group) if mp.tp.size > 1 else out
        rows = token_block(x.shape[0], mp.tp)
        mp.record_load(self.tag, topk_ids[rows])
        work = mp.comm.dispatch(x[rows], topk_ids[rows], topk_weights[rows], self.tag)
        mine = mp.comm.combine(work, self.local_outputs(work))
        return gather_rows(mine, x.shape[0], mp.tp, mp.tp_group) if mp.tp.size > 1 else mine

    def local_outputs(self, work: LocalWork) -> torch.Tensor:
        """This rank's expert slots on a dispatched round's rows (unweighted), GEMMs shaped by the global plan."""
        with self.mp._load_lock:  # two-batch overlap: both lanes count (a shape: no sync)
            self.rows_served += work.x.shape[0]
        slots = self.placement.local_slots(self.mp.ep_rank)
        return _local_expert_outputs(work, self.w13, self.w2, self.limit,
                                     self.placement.slot_experts[slots.start:slots.stop])

    def swap(self, placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Serve under `placement` with its slots' weights from the next MoE call on (between steps only)."""
        for param, new in ((self.w13, w13), (self.w2, w2)):
            if param.shape == new.shape:
                param.data.copy_(new)  # in place: anything holding the storage stays valid
            else:
                param.data = new
        self.placement = placement

    # --- kept quantised ----------------------------------------------------------------------------
    def keep_quantized(self, kind: str, block: tuple[int, int], dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        """From here on store w13 / w2 as `kind` codes of `dtype` with scales (UE8M0 kept as such, any other scale
        dtype as float32), uninitialised: call before loading. ValueError under TP / EP (not supported) or when
        the shapes cannot be stacked (quantized_expert_shapes)."""
        if not self.mp.is_single:
            raise ValueError("kept-quantised routed experts need a single process: tensor / expert parallelism "
                             "with quantised expert weights is not supported (load them dequantised)")
        e, two_i, d = self.w13.shape
        shapes = quantized_expert_shapes(kind, e, two_i // 2, d, block)
        if shapes is None:
            raise ValueError(f"{kind} experts of intermediate size {two_i // 2}, hidden {d} cannot be stacked with "
                             f"block {tuple(block)} (see quantized_expert_shapes)")
        scale_dtype = scale_dtype if scale_dtype == torch.float8_e8m0fnu else torch.float32
        device = self.w13.device
        (self.w13, self.w13_scale), (self.w2, self.w2_scale) = (
            (_frozen(w, dtype, device), _frozen(s, scale_dtype, device)) for w, s in shapes)
        self.w13.expert_quant = ExpertQuant(kind, self.w13_scale, tuple(block))
        self.w2.expert_quant = ExpertQuant(kind, self.w2_scale, tuple(block))
        self.quant = kind

    def keep_int4(self, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
                  group: int) -> None:
        """Store w13 / w2 as packed int4 from here on, each given as (codes [E, N, K] uint8, float16 (scale, zero)
        params [E, N, K / group, 2]) of the full stacked layout (layers/int4_linear.py); w13_scale / w2_scale hold
        the params, and the float weights are dropped. One process only (ValueError otherwise)."""
        if not self.mp.is_single:
            raise ValueError("packed int4 experts need a single process (tensor / expert parallelism loads them "
                             "dequantised)")
        from deepinfer.layers.int4_linear import pack_nibbles

        for name, (codes, params) in (("w13", w13), ("w2", w2)):
            device = getattr(self, name).device
            weight = nn.Parameter(pack_nibbles(codes).to(device), requires_grad=False)
            setattr(self, name, weight)
            setattr(self, f"{name}_scale", nn.Parameter(params.to(torch.float16).to(device), requires_grad=False))
            weight.expert_quant = ExpertQuant("int4", getattr(self, f"{name}_scale"), (1, group))
        self.quant = "int4"

    def scale_slot(self, local: int, half: int | None) -> torch.Tensor:
        """The view of w13_scale (gate: half 0, up: half 1) or w2_scale (half None) that local expert `local`'s
        checkpoint scale fills (kept quantised only)."""
        if half is None:
            return self.w2_scale[local]
        rows = self.w13_scale.shape[1] // 2
        return self.w13_scale[local, half * rows:(half + 1) * rows]

    def _apply(self, fn, recurse: bool = True):
        if self.quant is None:
            return super()._apply(fn, recurse)
        return super()._apply(lambda t: _keep_dtype(fn, t), recurse)

    # --- loading ----------------------------------------------------------------------------------
    def local_index(self, expert: int) -> int | None:
        """Row of w13 / w2 holding global expert `expert` at load time (the contiguous block), or None when
        another rank holds it. EPLB placements are applied after loading (ExpertRebalancer.start)."""
        return expert - self.local.start if expert in self.local else None

    def shard_weight(self, tensor: torch.Tensor, half: int | None) -> torch.Tensor:
        """A checkpoint expert matrix as this rank stores it: w1 / w3 [I, D] (half 0 / 1) or w2 [D, I]."""
        if self.mp.expert_parallel or self.mp.tp.size == 1:
            return tensor
        dim = 1 if half is None else 0
        per = tensor.shape[dim] // self.mp.tp.size
        return tensor.narrow(dim, self.mp.tp.rank * per, per).clone(memory_format=torch.contiguous_format)


def quantized_expert_shapes(kind: str, experts: int, inter: int, dim: int, block: tuple[int, int]):
    """((w13, w13_scale), (w2, w2_scale)) storage shapes of `experts` stacked quantised experts, or None when the
    per-expert checkpoint tensors cannot be stacked into them: FP8 gate and up scales concatenate into w13's grid
    only when `block[0]` divides the intermediate size; MXFP4 packs two inputs a byte (even D and I)."""
    bn, bk = block
    if kind == "fp8" and inter % bn == 0:
        return (((experts, 2 * inter, dim), (experts, 2 * inter // bn, -(-dim // bk))),
                ((experts, dim, inter), (experts, -(-dim // bn), -(-inter // bk))))
    if kind == "mxfp4" and dim % 2 == 0 and inter % 2 == 0:
        return (((experts, 2 * inter, dim // 2), (experts, 2 * inter, -(-dim // FP4_GROUP))),
                ((experts, dim, inter // 2), (experts, dim, -(-inter // FP4_GROUP))))
    return None


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised parameter without grad (quantised storage is never trained)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def token_block(num_rows: int, tp: TPRank) -> slice:
    """The rows TP rank tp.rank dispatches: a contiguous block of ceil(N / T) (the last ones shorter or empty)."""
    per = -(-num_rows // tp.size)
    return slice(min(tp.rank * per, num_rows), min((tp.rank + 1) * per, num_rows))


def gather_rows(mine: torch.Tensor, num_rows: int, tp: TPRank, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every TP rank's token_block rows back into [num_rows, D] (an equal-sized all-gather of padded blocks)."""
    per = -(-num_rows // tp.size)
    padded = mine.new_zeros(per, mine.shape[1])
    padded[:mine.shape[0]] = mine
    out = mine.new_empty(tp.size * per, mine.shape[1])
    _all_gather_single(out, padded, group=group)
    return out[:num_rows]


__all__ = ["ModelParallel", "ParallelExperts", "gather_rows", "quantized_expert_shapes", "token_block"]
