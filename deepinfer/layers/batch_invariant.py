"""Batch-invariant execution: a token's numbers never depend on what else runs in the step.

Every kernel's reduction order is a function of its shapes. A token computed alone, as a one-token
step, sees shapes that depend only on its own request (its position, its cache): the same GEMV for
every projection, the same key count in attention, the same expert path. So deterministic mode runs
the model one token at a time, in the order prefill and decode would, and takes the logits of each
needed row with a one-row GEMV. Prefill chunking, batch size, batch position and preemption then
cannot change a single bit; the price is per-token Python and kernel overhead (docs/determinism.md).

Sampling draws from a generator seeded from (seed, key, position) so a draw never depends on the
batch either.
"""

from __future__ import annotations

import bisect
import hashlib

import torch

from deepinfer.layers.metadata import ForwardMeta


def token_meta(meta: ForwardMeta, t: int) -> ForwardMeta:
    """The one-token step of flat row t of `meta`; tensors sized by that token's own request only."""
    r = bisect.bisect_right(meta.query_start, t) - 1  # host lists only: no device sync per token
    pos = meta.seq_starts[r] + t - meta.query_start[r]
    blocks = -(-(pos + 1) // meta.block_size)
    write_from = meta.paged_write_from[r] if meta.paged_write_from is not None else meta.seq_starts[r]
    return ForwardMeta(
        input_ids=meta.input_ids[t:t + 1], positions=meta.positions[t:t + 1],
        token_req=torch.zeros(1, dtype=torch.long, device=meta.device),
        block_table=meta.block_table[r:r + 1, :blocks], state_slots=meta.state_slots[r:r + 1],
        logits_indices=meta.logits_indices[:0], query_start=[0, 1], seq_starts=[pos], seq_lens=[pos + 1],
        block_size=meta.block_size, paged_write_from=[max(write_from, pos)])


def forward_per_token(model: torch.nn.Module, meta: ForwardMeta, rows: list[int]) -> torch.Tensor:
    """Logits [len(rows), V] of flat rows `rows`, the model run one token at a time in flat order
    (within a request that is position order, which is what the caches need)."""
    wanted = {row: i for i, row in enumerate(rows)}
    out: list[torch.Tensor | None] = [None] * len(rows)
    for t in range(meta.num_tokens):
        hidden = model(token_meta(meta, t))
        if t in wanted:
            out[wanted[t]] = model.compute_logits(hidden)
    if not out:
        return torch.empty(0, model.config.vocab_size, device=meta.device)
    return torch.cat(out)


def position_seed(seed: int, key: str, position: int) -> int:
    """A 63-bit seed from (seed, key, position): independent streams per request and position."""
    digest = hashlib.blake2b(f"{seed}/{key}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
