"""A paged-cache driver for the MLA model, shared by tests/test_mla_model.py and the spawned ranks of
tests/test_mla_parallel.py (no transformers import: workers start fast)."""

from __future__ import annotations

import torch

from deepinfer.layers.metadata import ForwardMeta

BLOCK = 4


class PagedRun:
    """Drives the model as an engine would: ragged steps over a shuffled paged pool."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0, include_mtp: bool = False):
        self.model = model
        specs = model.kv_cache_spec(BLOCK, include_mtp=include_mtp)
        model.bind_kv_cache({s.name: torch.full((num_blocks, *s.shape), float("nan"), dtype=s.dtype)
                             for s in specs})
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _reserve(self, rid: int, length: int) -> None:
        blocks = self.blocks.setdefault(rid, [])
        while len(blocks) * BLOCK < length:
            blocks.append(self.free.pop())

    def _meta(self, chunks: list[tuple[int, list[int]]]) -> ForwardMeta:
        ids, pos, req, qs, starts, ends = [], [], [], [0], [], []
        for row, (rid, toks) in enumerate(chunks):
            start = self.lens.get(rid, 0)
            self._reserve(rid, start + len(toks))
            self.lens[rid] = start + len(toks)
            ids += toks
            pos += range(start, start + len(toks))
            req += [row] * len(toks)
            qs.append(len(ids))
            starts.append(start)
            ends.append(start + len(toks))
        width = max(len(self.blocks[rid]) for rid, _ in chunks)
        table = [self.blocks[rid] + [0] * (width - len(self.blocks[rid])) for rid, _ in chunks]
        return ForwardMeta(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), token_req=torch.tensor(req),
            block_table=torch.tensor(table), state_slots=torch.zeros(len(chunks), dtype=torch.long),
            logits_indices=torch.tensor(qs[1:]) - 1, query_start=qs, seq_starts=starts, seq_lens=ends,
            block_size=BLOCK)

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One ragged step over [(request id, new tokens)]; the logits [n, V] of each chunk."""
        meta, hidden = self.forward(chunks)
        with torch.no_grad():
            logits = self.model.compute_logits(hidden)
        return [logits[s:e] for s, e in zip(meta.query_start, meta.query_start[1:])]

    def forward(self, chunks: list[tuple[int, list[int]]]) -> tuple[ForwardMeta, torch.Tensor]:
        """One ragged step: its ForwardMeta and the final hidden [T, D]."""
        meta = self._meta(chunks)
        with torch.no_grad():
            return meta, self.model(meta)
