"""Expert-parallel routed-expert dispatch/combine over torch.distributed.

Every rank holds a contiguous block of experts (``place_experts``). ``MoEComm.dispatch`` turns this rank's
tokens into *local work*: one row per (token, k) pair that some rank must send through a local expert,
sorted by local expert id. The caller computes the unweighted expert output of each row and
``MoEComm.combine`` applies the routing weights and returns the sum over k for this rank's own tokens.

Invariants every implementation keeps:
- Every rank enters every collective of a call, in the same order, whatever its token count; a rank with
  zero tokens (an idle DP rank) sends empty chunks and gets an empty [0, D] result.
- A call's first collective (its header) carries the call's tag (its MoE layer). Ranks that have finished
  their step's MoE calls (or had none) ``drain``: they join the others' rounds with empty batches, running
  their local experts of the tagged layer for the active ranks' rows, until a header shows every rank
  draining. So ranks whose steps make different numbers of MoE calls (an idle DP replica, a replica that
  drafts with MTP while another does not) never deadlock: every rank ends every step with ``drain``.
- A token's K contributions are added in ascending global expert id, in the activation dtype, like
  ``routed_experts``; only the cross-rank reduction of ``AllGatherComm`` may regroup them.
- ``ep_routed_experts`` shapes a rank's expert GEMMs by the expert counts over all ranks (the single-process
  plan of ``sorted_expert_outputs``), so expert outputs carry ``routed_experts``' bits. The price on the
  padded path is padding every local expert to the global max count.
- Tensors travel as uint8 views packed into one [rows, bytes] buffer per collective, so fp8 and other
  dtypes gloo rejects move unchanged. Expert ids travel as int32, routing weights as fp32 (exact for
  fp32/bf16/fp16 weights; ``routed_experts`` casts them to the activation dtype before use, as here).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepinfer.layers.moe import MAX_PADDING_WASTE, sorted_expert_outputs, swiglu

ID_DTYPE = torch.int32
WEIGHT_DTYPE = torch.float32
COUNT_DTYPE = torch.int64
_ID_BYTES, _WEIGHT_BYTES, _COUNT_BYTES = 4, 4, 8
HEADER_BYTES = 3 * _COUNT_BYTES  # allgather's header: token count and the round's tag (as max and -min)
# torch 2.13 renamed the *_tensor collectives (same signatures) and deprecates the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# ----------------------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical expert slots in contiguous blocks per rank: rank r holds slots [starts[r], starts[r + 1]), and
    slot s holds logical expert phy2log[s] (None: slot s holds expert s, no replicas; place_experts).

    A logical expert with c replicas (slots ascending) serves the positions p of its n rows of a round
    (rank-major, then token order: the order every rank can compute) in c contiguous chunks: replica
    p * c // n. So the replica of a row is a pure function of the round's routing, and the rows a rank receives
    from each peer follow from the per-expert counts alone (rows_from)."""

    num_experts: int
    starts: tuple[int, ...]  # ep_size + 1 non-decreasing slot boundaries, starts[0] = 0
    phy2log: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.starts or self.starts[0] != 0 or any(b < a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"slot boundaries must start at 0 and never decrease, got {self.starts}")
        slots = self.starts[-1]
        if self.phy2log is None:
            if slots != self.num_experts:
                raise ValueError(f"an identity placement needs {self.num_experts} slots, got {slots}")
            return
        if len(self.phy2log) != slots or not all(0 <= e < self.num_experts for e in self.phy2log):
            raise ValueError(f"phy2log needs {slots} expert ids in [0, {self.num_experts})")
        if len(set(self.phy2log)) != self.num_experts:
            raise ValueError("every logical expert needs at least one slot")

    @classmethod
    def from_phy2log(cls, phy2log: Sequence[int], num_experts: int, ep_size: int) -> ExpertPlacement:
        """A policy's slot row (GPU-major, equal slots per rank) as a placement; identity rows become None."""
        per, extra = divmod(len(phy2log), ep_size)
        if extra:
            raise ValueError(f"{len(phy2log)} expert slots do not split evenly over {ep_size} ranks")
        row = tuple(int(e) for e in phy2log)
        identity = row == tuple(range(num_experts))
        return cls(num_experts, tuple(r * per for r in range(ep_size + 1)), None if identity else row)

    @property
    def ep_size(self) -> int:
        return len(self.starts) - 1

    @property
    def num_slots(self) -> int:
        return self.starts[-1]

    @property
    def has_replicas(self) -> bool:
        """Some expert has several slots (then the all-to-all sends each row's position)."""
        return self.num_slots > self.num_experts

    @property
    def slot_experts(self) -> tuple[int, ...]:
        """Logical expert of every slot."""
        return tuple(range(self.num_experts)) if self.phy2log is None else self.phy2log

    def local_slots(self, rank: int) -> range:
        return range(self.starts[rank], self.starts[rank + 1])

    def local_experts(self, rank: int) -> range:
        """Global ids of the experts rank owns (identity placements); its local id i is local_experts(rank)[i]."""
        if self.phy2log is not None:
            raise ValueError("local_experts is for identity placements; use slot_experts and local_slots")
        return self.local_slots(rank)

    def owner(self, expert: int) -> int:
        return int(self.owner_of(torch.tensor([expert]))[0])

    def owner_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Owner rank of every slot id (for identity placements: of every global expert id) in slots."""
        bounds = torch.tensor(self.starts[1:], dtype=slots.dtype, device=slots.device)
        return torch.bucketize(slots, bounds, right=True)

    def local_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Every slot id as an index into its owner's local weights."""
        starts = torch.tensor(self.starts, dtype=slots.dtype, device=slots.device)
        return slots - starts[self.owner_of(slots)]

    @cached_property
    def _replicas(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(replica count [E], slots of each expert ascending [E, max count] padded -1, replica index [slots],
        logical expert [slots])."""
        by_expert: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slot_experts):
            by_expert[e].append(slot)
        width = max(len(s) for s in by_expert)
        table = torch.tensor([s + [-1] * (width - len(s)) for s in by_expert], dtype=torch.long)
        index = torch.tensor([by_expert[e].index(slot) for slot, e in enumerate(self.slot_experts)])
        experts = torch.tensor(self.slot_experts, dtype=torch.long)
        return torch.tensor([len(s) for s in by_expert]), table, index, experts

    def holds(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[E] bool: whether `rank` holds a slot of each expert."""
        mine = self.local_slots(rank)
        held = torch.zeros(self.num_experts, dtype=torch.bool, device=device)
        held[self._replicas[3][mine.start:mine.stop].to(device)] = True
        return held

    def slot_of(self, ids: torch.Tensor, pos: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """Slot serving each row: logical ids, positions among their expert's plan[e] rows of the round."""
        if self.phy2log is None:
            return ids
        count, table, _, _ = (t.to(ids.device) for t in self._replicas)
        return table[ids, pos * count[ids] // plan[ids]]

    def rows_from(self, rank: int, counts: torch.Tensor) -> torch.Tensor:
        """[sources] rows each rank sends to `rank`'s slots, from counts [sources, E] of every rank's rows."""
        mine = self.local_slots(rank)
        if self.phy2log is None:
            return counts[:, mine.start:mine.stop].sum(1)
        count, _, index, slot_experts = (t.to(counts.device) for t in self._replicas)
        experts = slot_experts[mine.start:mine.stop]
        n, c, j = counts.sum(0)[experts], count[experts], index[mine.start:mine.stop]
        lo, hi = (j * n + c - 1) // c, ((j + 1) * n + c - 1) // c  # the slots' chunks of positions
        first = (counts.cumsum(0) - counts)[:, experts]  # [sources, local slots] each source's first position
        overlap = torch.minimum(first + counts[:, experts], hi) - torch.maximum(first, lo)
        return overlap.clamp(min=0).sum(1)


def place_experts(num_experts: int, ep_size: int) -> ExpertPlacement:
    """E experts on ep_size ranks in contiguous blocks; the first E % ep_size ranks hold one more.

    With E < ep_size the last ranks own no experts (they still take part in every collective)."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"need num_experts >= 1 and ep_size >= 1, got {num_experts}, {ep_size}")
    base, extra = divmod(num_experts, ep_size)
    sizes = [base + (r < extra) for r in range(ep_size)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return ExpertPlacement(num_experts, tuple(starts))


# ----------------------------------------------------------------------------------------- byte views


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] of any dtype as uint8 [N, row_bytes] sharing its bytes (fp8 crosses gloo this way)."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of as_bytes: uint8 [N, row_bytes] back to [N, *shape] of dtype."""
    return b.contiguous().reshape(-1).view(dtype).reshape(b.shape[0], *shape)


def pack_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """Row-wise concatenation of the byte views of tensors that share dim 0."""
    return torch.cat([as_bytes(t) for t in tensors], dim=1)


def unpack_rows(buf: torch.Tensor, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Split pack_rows output back into tensors; layout is (dtype, per-row shape) in packing order."""
    out, col = [], 0
    for dtype, shape in layout:
        width = torch.Size(shape).numel() * dtype.itemsize
        out.append(from_bytes(buf[:, col:col + width], dtype, shape))
        col += width
    return out


# ----------------------------------------------------------------------------------------- interface


@dataclass
class LocalWork:
    """Rows this rank runs through its own expert slots: slot expert_ids[n] (local slot id) applied to x[n].

    Rows are sorted by slot and, within a slot, by pos: the row's position among all rows of its logical expert
    over all ranks (rank-major, then token order: the order routed_experts gives the whole batch). With one slot
    per expert the positions of a slot are 0..n-1. handle is the implementation's bookkeeping for combine."""

    x: torch.Tensor  # [N, D]
    expert_ids: torch.Tensor  # [N] int64 local slot ids, non-decreasing
    plan_counts: torch.Tensor  # [E] rows per logical expert over all ranks: the single-process GEMM plan
    handle: object = None
    tag: int = 0  # the MoE layer of the round (agreed by every active rank)
    pos: torch.Tensor | None = None  # [N] int64 positions (None: 0..n-1 within each slot)


class MoEComm(ABC):
    """Routed-expert dispatch/combine; one call pair per MoE layer forward, on every rank of the group."""

    name = "abstract"

    def __init__(self, placement: ExpertPlacement, rank: int = 0, group=None):
        self.placement, self.rank, self.group = placement, rank, group
        self.payload_bytes = 0  # bytes collectives delivered to this rank since construction (see bytes_moved)
        # The placement of MoE layer `tag` (EPLB gives layers their own; every rank agrees on each layer's).
        self.placement_for: Callable[[int], ExpertPlacement] = lambda tag: self.placement

    @property
    def local_experts(self) -> range:
        return self.placement.local_experts(self.rank)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 tag: int = 0) -> LocalWork:
        """x [T, D], global topk ids/weights [T, K] of this rank's tokens -> rows for the local experts.

        tag names the MoE layer (every active rank of a round passes the same one): a draining rank runs its
        local experts of that layer on the rows it receives."""
        return self._dispatch(x, topk_ids, topk_weights, tag)

    @abstractmethod
    def _dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  tag: int | None) -> LocalWork | None:
        """dispatch; tag None is a draining rank's dummy round. Returns None when every rank is draining."""

    def drain(self, compute: Callable[[LocalWork], torch.Tensor], hidden: int, topk: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> int:
        """Join the other ranks' remaining MoE calls with an empty batch until every rank drains (collective).

        compute(work) runs this rank's experts of layer work.tag on work's rows (a drained round still
        computes the local experts for the active ranks' tokens). hidden, topk and dtype are the real calls'.
        Returns how many rounds this rank joined."""
        x = torch.empty(0, hidden, dtype=dtype, device=device)
        ids = torch.empty(0, topk, dtype=torch.long, device=device)
        weights = torch.empty(0, topk, dtype=WEIGHT_DTYPE, device=device)
        rounds = 0
        while (work := self._dispatch(x, ids, weights, None)) is not None:
            self.combine(work, compute(work))
            rounds += 1
        return rounds

    @abstractmethod
    def combine(self, work: LocalWork, out: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs [N, D] of work's rows -> [T, D] weighted sums for this rank's tokens."""


def _agreed_tag(high: int, low: int) -> int | None:
    """The tag every active rank passed (None: no rank active). Differing tags mean the ranks' MoE calls went
    out of step, which would silently mix layers: fail loudly instead."""
    if high < 0:
        return None
    if high != low:
        raise RuntimeError(f"expert-parallel ranks are in different MoE layers (tags {low} and {high})")
    return high


def _expert_order(flat_ids: torch.Tensor) -> torch.Tensor:
    """Permutation sorting (token, k) pairs by expert id, ties in pair order (as routed_experts sorts)."""
    return torch.argsort(flat_ids, stable=True)


def _slot_order(slot: torch.Tensor, pos: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Permutation sorting rows by (slot, position); a slot's positions are distinct and below bound (a 0-d
    tensor: no host sync)."""
    return torch.argsort(slot * bound + pos, stable=True)


def _weighted_sum(num_tokens: int, token_of: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over pairs of weight * out into their tokens; pairs arrive in expert order, so each token's terms do."""
    acc = out.new_zeros(num_tokens, out.shape[1])
    return acc.index_add_(0, token_of, out * weights.to(out.dtype).unsqueeze(-1))


class LocalComm(MoEComm):
    """World of one: every expert is local; no collective runs."""

    name = "local"

    def _dispatch(self, x, topk_ids, topk_weights, tag):
        if tag is None:  # no peers: nothing to drain
            return None
        flat_ids = topk_ids.reshape(-1)
        order = _expert_order(flat_ids)
        token_of = order // topk_ids.shape[1]
        handle = (x.shape[0], token_of, topk_weights.reshape(-1)[order])
        plan = torch.bincount(flat_ids, minlength=self.placement.num_experts)
        return LocalWork(x[token_of], flat_ids[order], plan, handle, tag)

    def combine(self, work, out):
        return _weighted_sum(*work.handle[:2], out, work.handle[2])


# ----------------------------------------------------------------------------------------- all-gather


class _CollectiveComm(MoEComm):
    """An implementation over a process group whose ranks are the placement's EP ranks."""

    def __init__(self, placement: ExpertPlacement, rank: int, group=None):
        super().__init__(placement, rank, group)
        if dist.get_world_size(group) != placement.ep_size:
            raise ValueError(f"placement for {placement.ep_size} ranks, group of {dist.get_world_size(group)}")


class AllGatherComm(_CollectiveComm):
    """Every rank gathers all tokens (padded to the max count), runs its experts on them, then reduces.

    reduce="all_reduce" sums the [world * Tmax, D] partials with all_reduce and keeps this rank's slice;
    reduce="reduce_scatter" uses reduce_scatter_tensor. "auto" picks all_reduce for CPU tensors (gloo's
    reduce_scatter is a slow path, never faster than all_reduce there: docs/parallelism.md) and
    reduce_scatter elsewhere (NCCL, where it moves half the bytes). Both take the same input bytes."""

    name = "allgather"

    def __init__(self, placement, rank, group=None, reduce: str = "auto"):
        super().__init__(placement, rank, group)
        if reduce not in ("auto", "all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown reduce {reduce!r}")
        self.reduce = reduce

    def _dispatch(self, x, topk_ids, topk_weights, tag):
        num_tokens, k = topk_ids.shape
        tmax, tag = self._header(num_tokens, tag, x.device)
        if tag is None:
            return None
        ids, weights, rows = self._gather(x, topk_ids, topk_weights, tmax)
        placement = self.placement_for(tag)
        flat_ids = ids.reshape(-1).long()
        valid = flat_ids >= 0  # padding ids are -1
        plan = torch.bincount(flat_ids[valid], minlength=placement.num_experts)
        held = placement.holds(self.rank, flat_ids.device)
        # every row of each expert this rank holds a slot of (so positions within an expert are complete)
        pairs = torch.nonzero(valid & held[flat_ids.clamp(min=0)]).squeeze(1)
        pairs = pairs[_expert_order(flat_ids[pairs])]
        experts, kept = flat_ids[pairs], plan * held
        pos = torch.arange(pairs.numel(), device=pairs.device) - (kept.cumsum(0) - kept)[experts]
        slots = placement.local_slots(self.rank)
        slot = placement.slot_of(experts, pos, plan) - slots.start
        mine = torch.nonzero((slot >= 0) & (slot < len(slots))).squeeze(1)  # in expert order
        by_slot = _slot_order(slot[mine], pos[mine], plan.sum() + 1)
        token_of = pairs[mine] // k
        handle = (num_tokens, tmax, token_of, weights.reshape(-1)[pairs[mine]], by_slot)
        rows_by_slot = mine[by_slot]
        return LocalWork(rows[token_of[by_slot]], slot[rows_by_slot], plan, handle, tag, pos[rows_by_slot])

    def combine(self, work, out):
        num_tokens, tmax, token_of, weights, by_slot = work.handle
        world = self.placement.ep_size
        by_expert = torch.empty_like(out)
        by_expert[by_slot] = out  # each token's terms added in ascending expert id, whatever the slots
        partial = _weighted_sum(world * tmax, token_of, by_expert, weights)
        mine = self._reduce(partial, tmax)
        return mine[:num_tokens]

    def _header(self, num_tokens: int, tag: int | None, device) -> tuple[int, int | None]:
        """(max token count, the active ranks' tag or None when all drain): one all_reduce (MAX) of
        [count, tag, -tag], -1 and -2**62 standing in for a draining rank's tag."""
        mine = [num_tokens, -1, -(2**62)] if tag is None else [num_tokens, tag, -tag]
        head = torch.tensor(mine, dtype=COUNT_DTYPE, device=device)
        self.payload_bytes += self.placement.ep_size * HEADER_BYTES
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=self.group)
        tmax, high, neg_low = head.tolist()
        return tmax, _agreed_tag(high, -neg_low)

    def _gather(self, x, topk_ids, topk_weights, tmax):
        """All ranks' (ids, weights, x) as [world * Tmax, ...]; rank r's tokens start at row r * Tmax."""
        num_tokens, k = topk_ids.shape
        ids = torch.full((tmax, k), -1, dtype=ID_DTYPE, device=x.device)
        ids[:num_tokens] = topk_ids
        weights = torch.zeros(tmax, k, dtype=WEIGHT_DTYPE, device=x.device)
        weights[:num_tokens] = topk_weights
        rows = x.new_zeros(tmax, *x.shape[1:])
        rows[:num_tokens] = x
        send = pack_rows(ids, weights, rows)
        recv = send.new_empty(self.placement.ep_size * tmax, send.shape[1])
        self.payload_bytes += recv.numel()
        _all_gather_single(recv, send, group=self.group)
        return unpack_rows(recv, [(ID_DTYPE, (k,)), (WEIGHT_DTYPE, (k,)), (x.dtype, tuple(x.shape[1:]))])

    def _reduce(self, partial: torch.Tensor, tmax: int) -> torch.Tensor:
        """This rank's [Tmax, D] rows of the sum over ranks of partial [world * Tmax, D]."""
        # reduce-scatter payload: every rank's [Tmax, D] chunk for this rank (a ring all_reduce moves ~2x)
        self.payload_bytes += partial.numel() * partial.element_size()
        if self.reduce == "reduce_scatter" or (self.reduce == "auto" and partial.device.type != "cpu"):
            mine = partial.new_empty(tmax, partial.shape[1])
            _reduce_scatter_single(mine, partial, group=self.group)
            return mine
        dist.all_reduce(partial, group=self.group)
        return partial[self.rank * tmax:(self.rank + 1) * tmax]


# ----------------------------------------------------------------------------------------- all-to-all


class AllToAllComm(_CollectiveComm):
    """Each (token, k) pair travels to the owner of its slot and its output comes back (all_to_all_single).

    Pairs are sorted by expert (the combine order), then stably by owner for the send layout; a row's position
    among its expert's rows of the round is its source's offset (the exchanged counts) plus its place in the
    source's sorted pairs, so every rank derives the slot of every row and how many rows each peer sends it."""

    name = "alltoall"

    def _dispatch(self, x, topk_ids, topk_weights, tag):
        flat_ids = topk_ids.reshape(-1)
        counts, tag = self._exchange_counts(flat_ids, tag)
        if tag is None:
            return None
        placement = self.placement_for(tag)
        order = _expert_order(flat_ids)
        experts, plan, mine = flat_ids[order].long(), counts.sum(0), counts[self.rank]
        first = (counts.cumsum(0) - counts)[self.rank] - (mine.cumsum(0) - mine)
        pos = first[experts] + torch.arange(experts.numel(), device=experts.device)
        slot = placement.slot_of(experts, pos, plan)
        owner = placement.owner_of(slot)
        send_order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=placement.ep_size).tolist()
        recv_counts = placement.rows_from(self.rank, counts).tolist()
        token_of = order // topk_ids.shape[1]
        recv_ids, recv_pos, rows = self._send_rows(placement, slot, pos, x[token_of], send_order, send_counts,
                                                   recv_counts)
        # by slot, then position (source rank, origin order); with one slot per expert arrival order is position
        # order
        local_order = _expert_order(recv_ids) if recv_pos is None else _slot_order(recv_ids, recv_pos, plan.sum() + 1)
        handle = (x.shape[0], token_of, topk_weights.reshape(-1)[order], send_counts, recv_counts, local_order,
                  send_order)
        pos = None if recv_pos is None else recv_pos[local_order]
        return LocalWork(rows[local_order], recv_ids[local_order], plan, handle, tag, pos)

    def _send_rows(self, placement, slot, pos, rows, send_order, send_counts, recv_counts):
        """(local slot ids, positions or None, rows) this rank receives: rows go out in send_order; positions
        travel only with replicas (one slot per expert: a slot's arrival order is its position order)."""
        parts = [placement.local_index(slot)[send_order].to(ID_DTYPE), rows[send_order]]
        if placement.has_replicas:
            parts.insert(1, pos[send_order].to(ID_DTYPE))
        layout = [(ID_DTYPE, ())] * (len(parts) - 1) + [(rows.dtype, tuple(rows.shape[1:]))]
        got = unpack_rows(self._all_to_all(pack_rows(*parts), send_counts, recv_counts), layout)
        return got[0].long(), (got[1].long() if len(got) == 3 else None), got[-1]

    def combine(self, work, out):
        num_tokens, token_of, weights, send_counts, recv_counts, local_order, send_order = work.handle
        reply = torch.empty_like(out)
        reply[local_order] = out
        back = from_bytes(self._all_to_all(as_bytes(reply), recv_counts, send_counts), out.dtype, out.shape[1:])
        by_expert = torch.empty_like(back)
        by_expert[send_order] = back
        return _weighted_sum(num_tokens, token_of, by_expert, weights)

    def _exchange_counts(self, flat_ids: torch.Tensor, tag: int | None) -> tuple[torch.Tensor, int | None]:
        """([world, E] pairs per (source rank, global expert), the active ranks' tag or None when all drain):
        each rank sends its count row, its tag (-1: draining) appended, to every rank."""
        world, num_experts = self.placement.ep_size, self.placement.num_experts
        mine = torch.bincount(flat_ids, minlength=num_experts).to(COUNT_DTYPE)
        row = torch.cat([mine, torch.tensor([-1 if tag is None else tag], dtype=COUNT_DTYPE, device=mine.device)])
        counts = torch.empty(world * (num_experts + 1), dtype=COUNT_DTYPE, device=flat_ids.device)
        self.payload_bytes += counts.numel() * _COUNT_BYTES
        dist.all_to_all_single(counts, row.repeat(world), group=self.group)
        counts = counts.reshape(world, num_experts + 1)
        tags = [t for t in counts[:, num_experts].tolist() if t >= 0]
        return counts[:, :num_experts], _agreed_tag(max(tags, default=-1), min(tags, default=-1))

    def _all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of uint8 send [sum send_counts, B] to each rank; returns [sum recv_counts, B] by source rank."""
        recv = send.new_empty(sum(recv_counts), send.shape[1])
        self.payload_bytes += recv.numel()
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv


# ----------------------------------------------------------------------------------------- EP forward


def ep_routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, local_w13: torch.Tensor,
                      local_w2: torch.Tensor, placement: ExpertPlacement, comm: MoEComm,
                      limit: float = 0.0) -> torch.Tensor:
    """routed_experts for this rank's tokens with only this rank's slots' weights (collective call).

    local_w13 [S_local, 2I, D] and local_w2 [S_local, D, I] are the slots placement gives comm.rank."""
    if placement != comm.placement:
        raise ValueError("comm was built for another placement")
    slots = placement.local_slots(comm.rank)
    if local_w13.shape[0] != len(slots):
        raise ValueError(f"rank {comm.rank} owns {len(slots)} expert slots, got weights for {local_w13.shape[0]}")
    work = comm.dispatch(x, topk_ids, topk_weights)
    experts = placement.slot_experts[slots.start:slots.stop]
    return comm.combine(work, _local_expert_outputs(work, local_w13, local_w2, limit, experts))


def _local_expert_outputs(work: LocalWork, w13: torch.Tensor, w2: torch.Tensor, limit: float,
                          slot_experts: Sequence[int] | None = None) -> torch.Tensor:
    """Unweighted expert outputs per row, with GEMMs shaped by the global plan (single-process bits).

    slot_experts: the logical expert of each local slot (None: slot i is the i-th expert of an identity block).
    Every row keeps the place it has in the single-process GEMM of its logical expert (its position), so a
    replica that serves part of an expert's rows still runs that GEMM's shape: a slot's rows never depend on
    which replica serves them. Replicated slots therefore compute their expert's padded rows (the exactness
    price on CPU, where BLAS rounding depends on the row count)."""
    if work.x.shape[0] == 0:  # also covers ranks that own no experts
        return work.x.new_zeros(0, w2.shape[1])
    counts = torch.bincount(work.expert_ids, minlength=w13.shape[0])
    if work.pos is None or slot_experts is None:
        return sorted_expert_outputs(work.x, work.expert_ids, counts, w13, w2, limit, work.plan_counts)
    plan = work.plan_counts.tolist()
    if max(plan) * len(plan) <= MAX_PADDING_WASTE * sum(plan):
        return _placed_batched(work, max(plan), w13, w2, limit)
    return _placed_loop(work, counts.tolist(), [plan[e] for e in slot_experts], w13, w2, limit)


def _placed_batched(work: LocalWork, capacity: int, w13: torch.Tensor, w2: torch.Tensor,
                    limit: float) -> torch.Tensor:
    """Rows at (slot, position) of [S_local, capacity, D]: routed_experts' padded batch, this rank's slots."""
    buf = work.x.new_zeros(w13.shape[0], capacity, work.x.shape[1])
    buf[work.expert_ids, work.pos] = work.x
    h = swiglu(torch.bmm(buf, w13.transpose(1, 2)), limit)
    return torch.bmm(h, w2.transpose(1, 2))[work.expert_ids, work.pos]


def _placed_loop(work: LocalWork, counts: list[int], rows_of: list[int], w13: torch.Tensor, w2: torch.Tensor,
                 limit: float) -> torch.Tensor:
    """One GEMM per slot of its expert's row count, rows at their positions (a slot with them all: as they are)."""
    out, start = torch.empty_like(work.x), 0
    for slot, n in enumerate(counts):
        if not n:
            continue
        rows = slice(start, start + n)
        xs = work.x[rows]
        if n < rows_of[slot]:
            xs = work.x.new_zeros(rows_of[slot], work.x.shape[1]).index_copy_(0, work.pos[rows], xs)
        y = F.linear(swiglu(F.linear(xs, w13[slot]), limit), w2[slot])
        out[rows] = y if n == rows_of[slot] else y[work.pos[rows]]
        start += n
    return out


# ----------------------------------------------------------------------------------------- bytes moved


def bytes_moved(kind: str, tokens: int | Sequence[int], hidden: int, topk: int, world: int, elem_size: int,
                experts: int, replicas: bool = False) -> int:
    """Payload bytes one dispatch + combine delivers to all ranks together (the sum of comm.payload_bytes).

    tokens is the token count of every rank, or one count per rank; elem_size is the activation dtype's.
    Each rank's chunk to itself is counted too (it crosses no wire), which makes this a pure function; the
    wire share is (world - 1) / world of it for allgather, and the same in expectation for alltoall under
    uniform routing. Per rank, with Tmax the max count and e = elem_size:
    - allgather: 24 world (header all_reduce: count, tag, -tag) + world Tmax (D e + 8 K) (every rank's rows,
      int32 ids, fp32 weights) + world Tmax D e (every rank's partial sums of this rank's rows: the
      reduce-scatter payload).
    - alltoall: 8 world (E + 1) (every rank's per-expert counts and tag) + the rows of the pairs routed here,
      D e + 4 bytes each (int32 slot; with replicas, `replicas`,
      also the int32 position), and on the way back D e per pair of this rank's own; summed over ranks both are
      sum(T) K pairs.
    - local: 0."""
    counts = [tokens] * world if isinstance(tokens, int) else list(tokens)
    if len(counts) != world:
        raise ValueError(f"{len(counts)} token counts for world {world}")
    row = hidden * elem_size
    if kind == "local":
        return 0
    if kind == "allgather":
        tmax = max(counts)
        per_rank = world * (HEADER_BYTES + tmax * (row + topk * (_ID_BYTES + _WEIGHT_BYTES)) + tmax * row)
        return world * per_rank
    if kind == "alltoall":
        pair = 2 * row + _ID_BYTES * (2 if replicas else 1)
        return world * world * (experts + 1) * _COUNT_BYTES + sum(counts) * topk * pair
    raise ValueError(f"unknown comm kind {kind!r}")
