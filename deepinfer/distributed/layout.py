"""Rank layout of a D x T world: pure arithmetic, no torch.distributed.

Global rank r = dp_rank * T + tp_rank. A TP group is the T consecutive ranks of one DP replica; a DP group
is the D ranks that share a tp_rank (one per replica); the EP group is the whole world when expert
parallelism is on, else None (experts are then sharded over the TP group like any other layer).
Every rank computes the same layout, so group lists come out in the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config import ParallelConfig

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class RankLayout:
    """The whole world's layout; `tp_groups[d]` is replica d, `dp_groups[t]` is tp_rank t across replicas."""

    parallel: ParallelConfig
    tp_groups: tuple[Ranks, ...]
    dp_groups: tuple[Ranks, ...]
    ep_group: Ranks | None

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def _check(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, {self.world_size}), got {rank!r}")
        return rank

    def dp_rank(self, rank: int) -> int:
        return self._check(rank) // self.parallel.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return self._check(rank) % self.parallel.tensor_parallel_size

    def tp_group(self, rank: int) -> Ranks:
        """The ranks of `rank`'s DP replica (its tensor-parallel peers, itself included)."""
        return self.tp_groups[self.dp_rank(rank)]

    def dp_group(self, rank: int) -> Ranks:
        """The ranks holding the same TP shard as `rank`, one per replica."""
        return self.dp_groups[self.tp_rank(rank)]

    def ep_rank(self, rank: int) -> int | None:
        """Position of `rank` in the EP group (its global rank, since EP spans the world), or None."""
        return None if self.ep_group is None else self._check(rank)


def make_layout(parallel: ParallelConfig, world_size: int | None = None) -> RankLayout:
    """The layout of `parallel`; `world_size`, when given (e.g. from torchrun), must equal D x T."""
    if world_size is not None and world_size != parallel.world_size:
        raise ValueError(f"world size {world_size} does not match data_parallel_size {parallel.data_parallel_size}"
                         f" x tensor_parallel_size {parallel.tensor_parallel_size} = {parallel.world_size}")
    d, t = parallel.data_parallel_size, parallel.tensor_parallel_size
    tp_groups = tuple(tuple(range(i * t, (i + 1) * t)) for i in range(d))
    dp_groups = tuple(tuple(range(j, d * t, t)) for j in range(t))
    ep_group = tuple(range(d * t)) if parallel.enable_expert_parallel else None
    return RankLayout(parallel, tp_groups, dp_groups, ep_group)
