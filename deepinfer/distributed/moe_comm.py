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

import torch
import torch.distributed as dist

from deepinfer.layers.moe import sorted_expert_outputs

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
    """Contiguous expert blocks: rank r owns global experts [starts[r], starts[r + 1])."""

    num_experts: int
    starts: tuple[int, ...]  # ep_size + 1 non-decreasing boundaries, starts[0] = 0, starts[-1] = num_experts

    @property
    def ep_size(self) -> int:
        return len(self.starts) - 1

    def local_experts(self, rank: int) -> range:
        """Global ids of the experts rank owns; its local id i is global id local_experts(rank)[i]."""
        return range(self.starts[rank], self.starts[rank + 1])

    def owner(self, expert: int) -> int:
        return next(r for r in range(self.ep_size) if expert < self.starts[r + 1])

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of every global expert id in ids (any shape)."""
        bounds = torch.tensor(self.starts[1:], dtype=ids.dtype, device=ids.device)
        return torch.bucketize(ids, bounds, right=True)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Every global expert id in ids as an index into its owner's local weights."""
        starts = torch.tensor(self.starts, dtype=ids.dtype, device=ids.device)
        return ids - starts[self.owner_of(ids)]


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
    """Rows this rank runs through its own experts: expert_ids[n] (local id) applied to x[n].

    Rows are sorted by expert and, within an expert, in global token order (rank-major), the order
    routed_experts gives the whole batch. handle is the implementation's bookkeeping for combine."""

    x: torch.Tensor  # [N, D]
    expert_ids: torch.Tensor  # [N] int64 local expert ids, non-decreasing
    plan_counts: torch.Tensor  # [E] pairs per global expert over all ranks: the single-process GEMM plan
    handle: object = None
    tag: int = 0  # the MoE layer of the round (agreed by every active rank)


class MoEComm(ABC):
    """Routed-expert dispatch/combine; one call pair per MoE layer forward, on every rank of the group."""

    name = "abstract"

    def __init__(self, placement: ExpertPlacement, rank: int = 0, group=None):
        self.placement, self.rank, self.group = placement, rank, group
        self.payload_bytes = 0  # bytes collectives delivered to this rank since construction (see bytes_moved)

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
        flat_ids = ids.reshape(-1).long()
        start, stop = self.local_experts.start, self.local_experts.stop
        pairs = torch.nonzero((flat_ids >= start) & (flat_ids < stop)).squeeze(1)
        pairs = pairs[_expert_order(flat_ids[pairs])]  # padding ids are -1, never local
        token_of = pairs // k
        handle = (num_tokens, tmax, token_of, weights.reshape(-1)[pairs])
        plan = torch.bincount(flat_ids[flat_ids >= 0], minlength=self.placement.num_experts)
        return LocalWork(rows[token_of], flat_ids[pairs] - start, plan, handle, tag)

    def combine(self, work, out):
        num_tokens, tmax, token_of, weights = work.handle
        world = self.placement.ep_size
        partial = _weighted_sum(world * tmax, token_of, out, weights)
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
    """Each (token, k) pair travels to its expert's owner and its output comes back (all_to_all_single).

    Pairs are sent in expert order, which is also owner order (blocks are contiguous), so one argsort gives
    the send layout, the receive layout is sorted by source then expert, and the reply lands in send order."""

    name = "alltoall"

    def _dispatch(self, x, topk_ids, topk_weights, tag):
        flat_ids = topk_ids.reshape(-1)
        counts, tag = self._exchange_counts(flat_ids, tag)
        if tag is None:
            return None
        order = _expert_order(flat_ids)
        send_counts = [int(counts[self.rank, r.start:r.stop].sum()) for r in self._blocks()]
        recv_counts = counts[:, self.local_experts.start:self.local_experts.stop].sum(1).tolist()
        token_of = order // topk_ids.shape[1]
        local_ids = self.placement.local_index(flat_ids[order])
        recv = self._all_to_all(pack_rows(local_ids.to(ID_DTYPE), x[token_of]), send_counts, recv_counts)
        recv_ids, rows = unpack_rows(recv, [(ID_DTYPE, ()), (x.dtype, tuple(x.shape[1:]))])
        local_order = _expert_order(recv_ids)  # by local expert, ties by source rank then origin order
        handle = (x.shape[0], token_of, topk_weights.reshape(-1)[order], send_counts, recv_counts, local_order)
        return LocalWork(rows[local_order], recv_ids[local_order].long(), counts.sum(0), handle, tag)

    def combine(self, work, out):
        num_tokens, token_of, weights, send_counts, recv_counts, local_order = work.handle
        reply = torch.empty_like(out)
        reply[local_order] = out
        back = self._all_to_all(as_bytes(reply), recv_counts, send_counts)
        return _weighted_sum(num_tokens, token_of, from_bytes(back, out.dtype, out.shape[1:]), weights)

    def _blocks(self) -> list[range]:
        return [self.placement.local_experts(r) for r in range(self.placement.ep_size)]

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
    """routed_experts for this rank's tokens with only this rank's experts' weights (collective call).

    local_w13 [E_local, 2I, D] and local_w2 [E_local, D, I] are the rows placement gives comm.rank."""
    if placement != comm.placement:
        raise ValueError("comm was built for another placement")
    if local_w13.shape[0] != len(placement.local_experts(comm.rank)):
        raise ValueError(f"rank {comm.rank} owns {len(placement.local_experts(comm.rank))} experts, "
                         f"got weights for {local_w13.shape[0]}")
    work = comm.dispatch(x, topk_ids, topk_weights)
    return comm.combine(work, _local_expert_outputs(work, local_w13, local_w2, limit))


def _local_expert_outputs(work: LocalWork, w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Unweighted expert_{id_n}(x_n) per row, with GEMMs shaped by the global plan (single-process bits)."""
    if work.x.shape[0] == 0:  # also covers ranks that own no experts
        return work.x.new_zeros(0, w2.shape[1])
    counts = torch.bincount(work.expert_ids, minlength=w13.shape[0])
    return sorted_expert_outputs(work.x, work.expert_ids, counts, w13, w2, limit, work.plan_counts)


# ----------------------------------------------------------------------------------------- bytes moved


def bytes_moved(kind: str, tokens: int | Sequence[int], hidden: int, topk: int, world: int, elem_size: int,
                experts: int) -> int:
    """Payload bytes one dispatch + combine delivers to all ranks together (the sum of comm.payload_bytes).

    tokens is the token count of every rank, or one count per rank; elem_size is the activation dtype's.
    Each rank's chunk to itself is counted too (it crosses no wire), which makes this a pure function; the
    wire share is (world - 1) / world of it for allgather, and the same in expectation for alltoall under
    uniform routing. Per rank, with Tmax the max count and e = elem_size:
    - allgather: 24 world (header all_reduce: count, tag, -tag) + world Tmax (D e + 8 K) (every rank's rows,
      int32 ids, fp32 weights) + world Tmax D e (every rank's partial sums of this rank's rows: the
      reduce-scatter payload).
    - alltoall: 8 world (E + 1) (every rank's per-expert counts and tag) + the rows of the pairs routed here,
      D e + 4 bytes each, and on the way back D e per pair of this rank's own; summed over ranks both are
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
        return world * world * (experts + 1) * _COUNT_BYTES + sum(counts) * topk * (2 * row + _ID_BYTES)
    raise ValueError(f"unknown comm kind {kind!r}")
