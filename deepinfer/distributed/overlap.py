"""Two-batch overlap: a step's requests split into two micro-batches whose forwards run on two threads, so one's
expert-parallel dispatch / combine is on the wire while the other computes.

Each micro-batch runs in its own lane (``ModelParallel.in_lane``): its own EP process group and comm, so the two
threads' collectives never interleave on one group and every rank pairs lane k with lane k. Every rank runs both
lanes every step, an empty micro-batch (or an idle replica) only draining its lane, so lanes pair up across ranks
whatever each replica's batch. The model's other collectives must not run on two threads at once, hence
tensor_parallel_size 1 (the DeepSeek layout: attention DP + expert parallelism).

Invariants: micro-batches are whole requests (attention never crosses them) and contiguous in row order, so the
concatenated hidden rows are the step's rows; ``meta.logits_indices`` is applied to them afterwards as usual.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.layers.metadata import ForwardMeta, sub_meta

LANES = 2


def split_point(query_lens: list[int]) -> int:
    """Requests [0, r) form micro-batch 0 and [r, R) micro-batch 1: the r (1 <= r < R) closest to half the
    tokens, the first such on ties; R when there is one request (micro-batch 1 is empty)."""
    if len(query_lens) < 2:
        return len(query_lens)
    total, acc, best, best_gap = sum(query_lens), 0, 1, None
    for r in range(1, len(query_lens)):
        acc += query_lens[r - 1]
        gap = abs(2 * acc - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = r, gap
    return best


class TwoBatchForward:
    """Drop-in for `model(meta)` on a rank: the two micro-batches' forwards on two lanes, each lane drained
    after its forward (so the rank's step needs no finish_step of its own)."""

    def __init__(self, model: torch.nn.Module, parallel: ModelParallel):
        if len(parallel.lane_groups) < LANES or parallel.tp.size != 1:
            raise ValueError("two-batch overlap needs expert parallelism with 2 EP lane groups and TP size 1")
        self.model, self.parallel = model, parallel
        parallel._two_lanes = True  # each lane drains; __call__ / idle end the rank's step once both are done
        self.pool = ThreadPoolExecutor(LANES, thread_name_prefix="deepinfer-lane")

    def __call__(self, meta: ForwardMeta) -> torch.Tensor:
        r = split_point(meta.query_lens())
        halves = [sub_meta(meta, 0, r), sub_meta(meta, r, meta.num_reqs) if r < meta.num_reqs else None]
        futures = [self.pool.submit(self._lane, k, half) for k, half in enumerate(halves)]
        hidden = [f.result() for f in futures]
        self.parallel.end_step()
        return torch.cat([h for h in hidden if h is not None])

    def idle(self) -> None:
        """An idle replica's step: both lanes only drain."""
        for future in [self.pool.submit(self._lane, k, None) for k in range(LANES)]:
            future.result()
        self.parallel.end_step()

    def _lane(self, k: int, meta: ForwardMeta | None) -> torch.Tensor | None:
        with torch.inference_mode(), self.parallel.in_lane(k):
            hidden = None if meta is None else self.model(meta)
            self.parallel.finish_step()
            return hidden
