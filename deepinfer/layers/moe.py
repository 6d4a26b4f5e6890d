"""Routed experts: token-sorted grouped compute over stacked expert weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up over the concatenated [gate | up] projection; V4 clamps both (limit > 0)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """sum_k weight_k * expert_{id_k}(x) for x [T, D], ids/weights [T, K], w13 [E, 2I, D], w2 [E, D, I]."""
    T, K = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // K
    xs = x[token_of]
    out_sorted = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            h = swiglu(F.linear(xs[rows], w13[expert]), limit)
            out_sorted[rows] = F.linear(h, w2[expert])
            start += n
    weights = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_sorted * weights)
    return out
