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


def tiled_sink_attention(q: torch.Tensor, tokens: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                         extra: torch.Tensor | None, extra_valid: torch.Tensor | None, sinks: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """sink_attention for tiles of queries sharing their keys, so each tile's keys are gathered once and every
    product is a matrix product over the tile's B * H query rows.

    q [T, H, d]; tokens [nt, B] the query row of each tile row; keys [nt, K, d] (key = value) with valid
    [nt, B, K]; extra: more keys, per tile [nt, E, d] or per tile row [nt, B, E, d], with extra_valid [nt, B, E].
    One softmax over all of a row's keys and the sink. Returns [nt * B, H, d] (tile rows, in order)."""
    nt, b = tokens.shape
    h, d = q.shape[1], q.shape[2]
    rows = q.float().index_select(0, tokens.flatten()).view(nt, b * h, d)
    logits = [_tile_logits(rows, keys.float(), valid, scale)]
    if extra is not None:
        logits.append(_tile_logits(rows, extra.float(), extra_valid, scale))
    sink = sinks.float().view(1, 1, h, 1).expand(nt, b, h, 1)
    probs = torch.softmax(torch.cat([*logits, sink], dim=-1), dim=-1)  # softmax subtracts the row max itself
    out = torch.bmm(probs[..., :keys.shape[1]].reshape(nt, b * h, -1), keys.float())
    if extra is not None:
        out = out + _tile_values(probs[..., keys.shape[1]:-1], extra.float())
    return out.view(nt * b, h, d).to(q.dtype)


def _tile_logits(rows: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """rows [nt, B * H, d] against per-tile keys [nt, K, d] or per-row keys [nt, B, K, d] -> [nt, B, H, K]."""
    nt, b = valid.shape[:2]
    if keys.dim() == 3:
        logits = torch.bmm(rows, keys.transpose(1, 2)).view(nt, b, -1, keys.shape[1])
    else:
        logits = torch.einsum("tbhd,tbkd->tbhk", rows.view(nt, b, -1, rows.shape[-1]), keys)
    return (logits * scale).masked_fill(~valid[:, :, None, :], float("-inf"))


def _tile_values(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [nt, B, H, K] over per-tile [nt, K, d] or per-row [nt, B, K, d] values -> [nt, B * H, d]."""
    nt, b, h, k = probs.shape
    if keys.dim() == 3:
        return torch.bmm(probs.reshape(nt, b * h, k), keys)
    return torch.einsum("tbhk,tbkd->tbhd", probs, keys).reshape(nt, b * h, -1)


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
