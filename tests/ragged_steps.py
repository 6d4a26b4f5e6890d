"""A ragged step's ForwardMeta for kernel tests: request r has starts[r] computed tokens and news[r] new ones,
its blocks drawn shuffled from a pool with spare ids (holes), its state slot shuffled among spare ones."""

from __future__ import annotations

import torch

from deepinfer.layers.metadata import ForwardMeta


def shuffled_table(blocks: list[int], spare: int = 3, seed: int = 1) -> torch.Tensor:
    """[R, max(blocks)] block ids, request r's first blocks[r] entries distinct, the rest 0."""
    ids = torch.randperm(sum(blocks) + spare, generator=torch.Generator().manual_seed(seed)).tolist()
    table, at = [], 0
    for b in blocks:
        table.append(ids[at:at + b] + [0] * (max(blocks, default=0) - b))
        at += b
    return torch.tensor(table)


def ragged_step(starts: list[int], news: list[int], block_size: int, table: torch.Tensor | None = None,
                spare_blocks: int = 3) -> ForwardMeta:
    pos = [p for s, n in zip(starts, news) for p in range(s, s + n)]
    req = [r for r, n in enumerate(news) for _ in range(n)]
    qs = [0]
    for n in news:
        qs.append(qs[-1] + n)
    ends = [s + n for s, n in zip(starts, news)]
    if table is None:
        table = shuffled_table([-(-e // block_size) for e in ends], spare_blocks)
    slots = torch.randperm(len(news) + 2, generator=torch.Generator().manual_seed(2))[:len(news)]
    return ForwardMeta(input_ids=torch.zeros(len(pos), dtype=torch.long), positions=torch.tensor(pos),
                       token_req=torch.tensor(req), block_table=table, state_slots=slots,
                       logits_indices=torch.tensor(qs[1:]) - 1, query_start=qs, seq_starts=starts, seq_lens=ends,
                       block_size=block_size)
