"""Batch-invariant execution: a token's numbers never depend on what else runs in the step.

Every kernel's reduction order is a function of its shapes, so deterministic mode makes every shape a
token's row meets depend on that token alone. The batched method (`batch_invariant()`, below) keeps
steps batched: fixed-tile matmuls, vectorised transcendental ops, attention per token over exactly its
own keys. Models without those kernels run one token at a time instead (`forward_per_token`), which is
invariant by construction but gives up batching (costs in docs/determinism.md).

Sampling draws from a generator seeded from (seed, key, position) so a draw never depends on the
batch either.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


# --- batched batch-invariant execution ---------------------------------------------------------------
# A row's bits must not depend on the step's other rows. Measured on the CPUs we test on:
# - a GEMM row's bits depend on the row count below 4 rows but not on the count or the row's position
#   once every call has one fixed row-tile shape, so matmuls run in ROW_TILE-row tiles (zero-padded);
# - ATen's elementwise kernels compute the body of a contiguous tensor with vectorised transcendental
#   functions and its tail with scalar ones (different rounding), so those ops run on a copy padded to a
#   multiple of VECTOR_PAD elements, which puts every element on the vectorised path;
# - attention and indexer scores run per token over exactly that token's keys (layers check
#   `batch_invariant_enabled`).
ROW_TILE = 16
VECTOR_PAD = 64
_aten = torch.ops.aten
_state = threading.local()


def batch_invariant_enabled() -> bool:
    """True inside `batch_invariant()` on this thread (the forward may run on a worker thread)."""
    return getattr(_state, "enabled", False)


def tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] as fixed ROW_TILE-row GEMMs."""
    m = a.shape[0]
    pad = -m % ROW_TILE
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    return torch.cat([_aten.mm.default(tile, b) for tile in a.split(ROW_TILE)])[:m]


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = tiled_mm(x.reshape(-1, x.shape[-1]), w.t()).reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return beta * bias + alpha * tiled_mm(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([tiled_mm(x, y) for x, y in zip(a, b)]) if a.shape[0] else _aten.bmm.default(a, b)


def _padded_elementwise(func):
    def run(x: torch.Tensor, *args, **kwargs):
        if x.is_contiguous() and x.numel() % VECTOR_PAD == 0 and x.numel():
            return func(x, *args, **kwargs)  # no tail: every element is on the vectorised path already
        flat = x.reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % VECTOR_PAD + VECTOR_PAD)])
        return func(padded, *args, **kwargs)[:flat.numel()].view(x.shape)

    return run


_TRANSCENDENTAL = ("sigmoid", "exp", "log", "silu", "rsqrt", "tanh", "softplus", "sin", "cos", "erf", "gelu",
                   "log1p", "expm1", "reciprocal")
_OVERRIDES = {_aten.linear.default: _linear, _aten.mm.default: tiled_mm, _aten.addmm.default: _addmm,
              _aten.bmm.default: _bmm}
_OVERRIDES.update({getattr(_aten, n).default: _padded_elementwise(getattr(_aten, n).default) for n in _TRANSCENDENTAL})


class _InvariantKernels(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _OVERRIDES.get(func, func)(*args, **(kwargs or {}))


@contextlib.contextmanager
def batch_invariant():
    """Run the enclosed forward with batch-invariant kernels; layers consult `batch_invariant_enabled`."""
    _state.enabled = True
    try:
        with _InvariantKernels():
            yield
    finally:
        _state.enabled = False
