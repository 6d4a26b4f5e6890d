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


SINK_BLOCK = 64  # keys per online-softmax step of the blocked kernel


def blocked_sink_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Shared-KV sink attention as DeepSeek-V4.1's sparse kernel computes it: an online softmax over blocks of
    SINK_BLOCK keys in column order, probabilities rounded to bf16 (relative to the running max) before the
    value product, float32 denominators, the sink logit unscaled. Column order therefore matters; invalid
    columns contribute nothing anywhere. q [T, H, d] bf16, kv [T, C, d] bf16, valid [T, C]. Returns bf16."""
    qf, kvf = q.float().unsqueeze(0), kv.float().unsqueeze(0)  # [1, T, ...]: the kernel's [b, m, ...] shapes
    t, h, d = q.shape
    acc = torch.zeros(1, t, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(1, t, h, dtype=torch.float32, device=q.device)
    running = torch.full((1, t, h), -1e30, dtype=torch.float32, device=q.device)
    factor = torch.tensor(scale, dtype=torch.float32)
    for start in range(0, kv.shape[1], SINK_BLOCK):
        ok = valid[None, :, start:start + SINK_BLOCK]
        block = kvf[:, :, start:start + SINK_BLOCK] * ok.unsqueeze(-1)
        logits = torch.where(ok.unsqueeze(2), torch.einsum("bmhd,bmkd->bmhk", qf, block), -torch.inf) * factor
        previous, running = running, torch.maximum(running, logits.amax(dim=-1))
        rescale = torch.exp(previous - running)
        probs = torch.exp(logits - running.unsqueeze(-1))
        denom = denom * rescale + probs.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", probs.to(torch.bfloat16).float(), block)
    denom = denom + torch.exp(sinks.float() - running)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)[0]
