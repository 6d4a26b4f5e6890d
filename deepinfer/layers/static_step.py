"""Fixed-shape step inputs for CUDA-graph replay: B request rows with q new tokens each (q = 1 for decode,
k + 1 for a speculative verify step), every tensor's shape fixed by (B, q, max_blocks).

A captured graph reads only these buffers, so a step is replayed by copying the step's values into them.
Nothing here holds a host list: code written against it cannot size a tensor from data (no host sync).
Padding rows (beyond the real requests) point at a scratch state slot and a scratch block that the
scheduler never hands out, so whatever they compute and write is never read by a real request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.metadata import host_long


@dataclass
class StaticStep:
    input_ids: torch.Tensor  # [B * q] int64
    positions: torch.Tensor  # [B * q]
    block_table: torch.Tensor  # [B, max_blocks]
    state_slots: torch.Tensor  # [B]
    seq_starts: torch.Tensor  # [B] tokens of each request computed before the step
    tokens_per_req: int  # q
    block_size: int

    @classmethod
    def empty(cls, batch: int, tokens_per_req: int, max_blocks: int, block_size: int, scratch_slot: int,
              scratch_block: int, device: torch.device) -> StaticStep:
        """Buffers describing `batch` padding rows (what a replay computes for rows nobody asked for)."""
        t = batch * tokens_per_req
        return cls(torch.zeros(t, dtype=torch.long, device=device),
                   torch.arange(t, device=device) % tokens_per_req,
                   torch.full((batch, max_blocks), scratch_block, dtype=torch.long, device=device),
                   torch.full((batch,), scratch_slot, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device), tokens_per_req, block_size)

    @classmethod
    def from_meta(cls, meta) -> StaticStep:
        """The step of a ForwardMeta whose requests all compute the same number of new tokens."""
        q = meta.num_tokens // max(meta.num_reqs, 1)
        starts = host_long(meta.seq_starts, meta.device)
        return cls(meta.input_ids, meta.positions, meta.block_table, meta.state_slots, starts, q, meta.block_size)

    # --- the ForwardMeta views layer code reads (same names and meanings) ---------------------------
    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def token_req(self) -> torch.Tensor:
        """[T] request row of each token: rows are grouped, q tokens per request."""
        return torch.arange(self.input_ids.numel(), device=self.device) // self.tokens_per_req

    @property
    def token_qstart(self) -> torch.Tensor:
        """[T] row of the first new token of the token's request."""
        return self.token_req * self.tokens_per_req

    @property
    def token_start(self) -> torch.Tensor:
        return self.seq_starts[self.token_req]

    def slots_of(self, req_rows: torch.Tensor, positions: torch.Tensor, entries_per_block: int = 0,
                 ratio: int = 1) -> torch.Tensor:
        per_block = entries_per_block or self.block_size // ratio
        blocks = self.block_table[req_rows, positions // per_block]
        return blocks * per_block + positions % per_block

    def copy_from(self, other: StaticStep) -> None:
        """Load a step of at most this many rows (the rest keep their padding values)."""
        t, b = other.input_ids.numel(), other.state_slots.numel()
        self.input_ids[:t].copy_(other.input_ids, non_blocking=True)
        self.positions[:t].copy_(other.positions, non_blocking=True)
        self.block_table[:b, :other.block_table.shape[1]].copy_(other.block_table, non_blocking=True)
        self.state_slots[:b].copy_(other.state_slots, non_blocking=True)
        self.seq_starts[:b].copy_(other.seq_starts, non_blocking=True)

    def reset_padding(self, rows: int, scratch_slot: int, scratch_block: int) -> None:
        """Rows [rows, B) back to padding (a smaller step after a larger one in the same bucket)."""
        q = self.tokens_per_req
        self.input_ids[rows * q:].zero_()
        self.positions[rows * q:].copy_(torch.arange(self.input_ids.numel() - rows * q, device=self.device) % q)
        self.block_table[rows:].fill_(scratch_block)
        self.state_slots[rows:].fill_(scratch_slot)
        self.seq_starts[rows:].zero_()
