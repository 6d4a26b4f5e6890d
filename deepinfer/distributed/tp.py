"""Tensor parallelism (TP) over a TP group: weight sharding helpers and the parallel layers the DeepSeek models
will be built from (mechanism only; no model uses it yet).

Weights are in nn.Linear layout [out_features, in_features]. TP rank r of T holds:
- column parallel: output rows [r * out / T, (r + 1) * out / T) (and that slice of the bias);
- row parallel: input columns [r * in / T, (r + 1) * in / T); the bias lives on the module, added once after the
  all-reduce;
- head / group parallel: the rows (or columns) of heads / groups [r * n / T, (r + 1) * n / T), each unit whole;
- vocab parallel: rows [r * ceil(V / T), ...) clipped to V (the one split that need not divide: V is padded).

Invariants:
- Every split but the vocabulary's must divide evenly; otherwise a ValueError names the tensor and the size.
- A shard owns its storage (never a view of the full weight), so the full tensor can be freed after slicing.
- Every rank enters every collective of a forward in the same order, whatever its row count: an empty batch
  ([0, D]) still all-reduces / all-gathers empty tensors, so a peer with rows never waits for it.
- Gathers are equal-sized all_gather_into_tensor calls (ragged vocab slices are padded), never list collectives.
- Reductions run in the activation dtype over the TP group (gloo on CPU, NCCL on CUDA, as backend.py chose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.moe_comm import _all_gather_single  # the one alias of the renamed all-gather
from deepinfer.layers.lm_head import logits_linear
from deepinfer.layers.moe import swiglu

# ----------------------------------------------------------------------------------------- pure sharding


@dataclass(frozen=True)
class TPRank:
    """This process's place in its TP group: rank `rank` of `size` (group ranks, not global ranks)."""

    rank: int
    size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside TP size {self.size}")

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> TPRank:
        """Rank and size within `group` (None: the default, whole-world group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group))


def shard_range(units: int, tp: TPRank, name: str, unit: str) -> range:
    """The `units` indices rank tp.rank holds: a contiguous block of units / size. Raises unless it divides."""
    if units % tp.size:
        raise ValueError(f"{name}: {unit} {units} is not divisible by tensor-parallel size {tp.size}")
    per = units // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def split_units(t: torch.Tensor, dim: int, units: int, tp: TPRank, name: str, unit: str) -> torch.Tensor:
    """Rank tp.rank's block of `units` equal units along `dim` of t (a unit: a row, a head, a group)."""
    if t.shape[dim] % units:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(t.shape)} is not a whole number of {units} {unit}")
    block = shard_range(units, tp, name, unit)
    width = t.shape[dim] // units
    return t.narrow(dim, block.start * width, len(block) * width).clone(memory_format=torch.contiguous_format)


def column_shard(t: torch.Tensor, tp: TPRank, name: str) -> torch.Tensor:
    """Output rows of a weight [out, in] (or a bias [out]) for column parallelism."""
    return split_units(t, 0, t.shape[0], tp, name, "output features")


def row_shard(t: torch.Tensor, tp: TPRank, name: str) -> torch.Tensor:
    """Input columns of a weight [out, in] for row parallelism."""
    return split_units(t, 1, t.shape[1], tp, name, "input features")


def head_shard(t: torch.Tensor, num_heads: int, tp: TPRank, name: str, dim: int = 0) -> torch.Tensor:
    """The local query heads' slice along `dim`: rows of wq_b / q_b_proj / kv_b_proj (dim 0, heads outermost),
    the columns of o_proj (dim 1), or a per-head vector such as attn_sink."""
    return split_units(t, dim, num_heads, tp, name, "heads")


def kv_head_shard(t: torch.Tensor, num_kv_heads: int, tp: TPRank, name: str) -> torch.Tensor:
    """KV-head rows: split when the KV heads divide over the ranks, else every rank keeps the KV head its query
    heads read (T % num_kv_heads == 0). One shared KV head (V4's MQA wkv) is replicated whole."""
    if num_kv_heads % tp.size == 0:
        return head_shard(t, num_kv_heads, tp, name)
    if tp.size % num_kv_heads:
        raise ValueError(f"{name}: {num_kv_heads} KV heads neither divide nor are a divisor of TP size {tp.size}")
    owner = TPRank(tp.rank * num_kv_heads // tp.size, num_kv_heads)
    return head_shard(t, num_kv_heads, owner, name)


def group_shard(t: torch.Tensor, num_groups: int, tp: TPRank, name: str, dim: int = 0) -> torch.Tensor:
    """The local groups of a grouped projection (V4's wo_a: rows of groups [r G / T, (r + 1) G / T))."""
    return split_units(t, dim, num_groups, tp, name, "groups")


def replicate(t: torch.Tensor) -> torch.Tensor:
    """A replicated weight (the MLA latent kv_a, V4's shared KV head, norms): every rank holds all of it."""
    return t


def vocab_range(vocab: int, tp: TPRank) -> range:
    """Token ids rank tp.rank holds: ceil(V / T) per rank, the last ranks' blocks clipped to V (maybe empty)."""
    per = -(-vocab // tp.size)
    return range(min(tp.rank * per, vocab), min((tp.rank + 1) * per, vocab))


def vocab_shard(t: torch.Tensor, tp: TPRank) -> torch.Tensor:
    """Rows vocab_range(V, tp) of an embedding / LM-head weight [V, D]."""
    ids = vocab_range(t.shape[0], tp)
    return t[ids.start:ids.stop].clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------- collectives


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [N, D] (N may be 0)."""
    return x.reshape(-1, x.shape[-1])


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of x over the group, in place (called for empty x too: every rank enters every collective)."""
    dist.all_reduce(x, group=group)
    return x


def gather_last_dim(x: torch.Tensor, tp: TPRank, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[..., n] on every rank -> [..., T n], rank r's block at columns [r n, (r + 1) n). Equal sizes only."""
    rows = _rows(x).contiguous()
    out = rows.new_empty(tp.size * rows.shape[0], rows.shape[1])
    _all_gather_single(out, rows, group=group)
    n, width = rows.shape
    full = out.view(tp.size, n, width).permute(1, 0, 2).reshape(n, tp.size * width)
    return full.view(*x.shape[:-1], tp.size * width)


# ----------------------------------------------------------------------------------------- modules


def _vocab_rows(weight: torch.Tensor, vocab: int, tp: TPRank, what: str) -> range:
    """The vocab ids a [rows, D] shard stands for; its row count must be len(vocab_range(vocab, tp))."""
    ids = vocab_range(vocab, tp)
    if weight.shape[0] != len(ids):
        raise ValueError(f"{what} shard has {weight.shape[0]} rows, TP rank {tp.rank} of {tp.size} holds "
                         f"{len(ids)} of the {vocab} ids")
    return ids


def _input_slice(x: torch.Tensor, width: int, tp: TPRank) -> torch.Tensor:
    """This rank's [..., width] block of a full [..., T width] input."""
    if x.shape[-1] != tp.size * width:
        raise ValueError(f"row-parallel input has {x.shape[-1]} features, expected {tp.size} x {width}")
    return x.narrow(-1, tp.rank * width, width)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split: a rank computes its output slice [..., out / T].
    gather_output=True all-gathers the full [..., out]. Bit-identical columns are typical (each is one rank's
    GEMM over the whole K) but not guaranteed: the GEMM may block K differently for a narrower N."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None,
                 gather_output: bool = False):
        """From this rank's shards: weight [out / T, in], bias [out / T] or None."""
        super().__init__()
        self.group, self.tp, self.gather_output = group, TPRank.of(group), gather_output
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: dist.ProcessGroup | None = None,
                  gather_output: bool = False, name: str = "weight") -> ColumnParallelLinear:
        tp = TPRank.of(group)
        b = None if bias is None else column_shard(bias, tp, f"{name} bias")
        return cls(column_shard(weight, tp, name), b, group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.tp, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split: a rank multiplies its input slice [..., in / T] (its own
    activations when input_is_parallel, else it slices the full x), the partial sums are all-reduced over the
    group and the bias is added once, after the sum. Not bit-identical to the single GEMM: the K sum is split
    into T partial sums added in another order (within ~1e-5 relative in fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None,
                 input_is_parallel: bool = True):
        """From this rank's shard: weight [out, in / T]; bias [out] (full: it is added once) or None."""
        super().__init__()
        self.group, self.tp, self.input_is_parallel = group, TPRank.of(group), input_is_parallel
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: dist.ProcessGroup | None = None,
                  input_is_parallel: bool = True, name: str = "weight") -> RowParallelLinear:
        return cls(row_shard(weight, TPRank.of(group), name), bias, group, input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _input_slice(x, self.weight.shape[1], self.tp)
        y = all_reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class _VocabSharded(nn.Module):
    """A [V, D] table whose rows are split by vocab_range: this rank holds rows `ids` of it."""

    what = "table"  # names the tensor in errors

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None):
        """From this rank's shard: rows vocab_range(vocab_size, tp) of the [V, D] table."""
        super().__init__()
        self.group, self.tp, self.vocab_size = group, TPRank.of(group), vocab_size
        self.ids = _vocab_rows(weight, vocab_size, self.tp, self.what)
        self.weight = nn.Parameter(weight, requires_grad=False)

    @classmethod
    def from_full(cls, weight: torch.Tensor, group: dist.ProcessGroup | None = None):
        return cls(vocab_shard(weight, TPRank.of(group)), weight.shape[0], group)


class VocabParallelEmbedding(_VocabSharded):
    """Embedding whose rows are split by vocab_range: a rank looks up the ids it holds, gives zeros for the
    others, and the group all-reduces. Bit-identical to nn.Embedding: each output row has exactly one non-zero
    contribution (x + 0 = x)."""

    what = "embedding"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.ids.start) & (ids < self.ids.stop)
        local = torch.where(mine, ids - self.ids.start, 0)
        out = F.embedding(local, self.weight) if len(self.ids) else self._zeros(ids)
        return all_reduce(out.masked_fill(~mine[..., None], 0), self.group)

    def _zeros(self, ids: torch.Tensor) -> torch.Tensor:
        """A rank with no vocab rows (V < T ceil-blocks) still contributes zeros of the right shape."""
        return self.weight.new_zeros(*ids.shape, self.weight.shape[1])


class ParallelLMHead(_VocabSharded):
    """Logits x W^T with W [V, D] split by vocab_range. forward returns the full [..., V] logits: local logits
    are padded to ceil(V / T) columns, all-gathered (equal sizes) and the padding dropped. local_logits gives
    this rank's [..., len(vocab_range)] slice, for samplers that reduce over the vocab themselves. Columns are
    typically bit-identical to the unsharded GEMM (see ColumnParallelLinear)."""

    what = "LM head"

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits_linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per = -(-self.vocab_size // self.tp.size)
        local = F.pad(self.local_logits(x), (0, per - len(self.ids)))
        return gather_last_dim(local, self.tp, self.group)[..., :self.vocab_size]


class TPMLP(nn.Module):
    """Dense swiglu MLP down(swiglu([gate(x) | up(x)])): gate and up column-parallel (fused into one local GEMM
    of [gate_r; up_r]), down row-parallel. One all-reduce per call. `limit` is swiglu's clamp (V4: > 0)."""

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear, limit: float = 0.0):
        super().__init__()
        self.gate_up, self.down, self.limit = gate_up, down, limit

    @classmethod
    def from_shards(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group: dist.ProcessGroup | None,
                    limit: float = 0.0) -> TPMLP:
        """From this rank's shards: gate, up [I / T, D] (column_shard) and down [D, I / T] (row_shard)."""
        if gate.shape != up.shape:
            raise ValueError(f"gate shard {tuple(gate.shape)} and up shard {tuple(up.shape)} differ")
        return cls(ColumnParallelLinear(torch.cat([gate, up]), None, group), RowParallelLinear(down, None, group),
                   limit)

    @classmethod
    def from_full(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  group: dist.ProcessGroup | None = None, limit: float = 0.0, name: str = "mlp") -> TPMLP:
        """From the full gate_proj / w1, up_proj / w3 [I, D] and down_proj / w2 [D, I] weights."""
        tp = TPRank.of(group)
        return cls.from_shards(column_shard(gate, tp, f"{name}.gate"), column_shard(up, tp, f"{name}.up"),
                               row_shard(down, tp, f"{name}.down"), group, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), self.limit))
