"""Torch reference attention kernels over gathered (ragged -> padded) key sets."""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit in the softmax denominator.

    q [T, H, d]; kv [T, K, d] is both key and value; valid [T, K] masks padding/causality;
    sinks [H]. Returns [T, H, d]. A query whose keys are all invalid attends only to the sink (output 0).
    """
    logits = torch.einsum("thd,tkd->thk", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, kv.float()).to(q.dtype)
