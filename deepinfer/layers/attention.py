"""Torch reference attention kernels over gathered (ragged -> padded) key sets."""

from __future__ import annotations

import torch

from deepinfer.layers.batch_invariant import batch_invariant_enabled


def sink_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit in the softmax denominator.

    q [T, H, d]; kv [T, K, d] is both key and value; valid [T, K] masks padding/causality;
    sinks [H]. Returns [T, H, d]. A query whose keys are all invalid attends only to the sink (output 0).
    """
    if batch_invariant_enabled():
        return _per_token(q, kv, valid, sinks, scale)
    logits = torch.einsum("thd,tkd->thk", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, kv.float()).to(q.dtype)


def _per_token(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Each query over exactly its own valid keys, so no shape depends on the other queries' key counts."""
    out = [sink_attention_one(q[t], kv[t][valid[t]], sinks, scale) for t in range(q.shape[0])]
    return torch.stack(out) if out else q.new_zeros(q.shape)


def sink_attention_one(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One query: q [H, d], kv [K, d] (all valid). Returns [H, d]."""
    logits = torch.cat([(q.float() @ kv.float().t()) * scale, sinks.float().view(-1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[:, :-1]
    return (probs @ kv.float()).to(q.dtype)
