"""Routed experts over stacked weights: token-sorted compute, one batched GEMM when groups are small.

Kept-quantised experts: a stacked weight stored quantised (fp8 block-scaled or MXFP4, kernels/fused_moe.py layouts)
carries an `expert_quant` attribute (ExpertQuant: kind, its scale tensor, the FP8 block), set by
ParallelExperts.keep_quantized; `routed_experts` then runs the fused kernels on CUDA and otherwise
`fused_moe_reference` (whole experts dequantised to float32 per call, the values the loader would have produced).
Packed int4 experts (AWQ, ParallelExperts.keep_int4) run the fused kernels' int4 mode on CUDA; elsewhere they
are dequantised to x's dtype per call and run the float path, so they compute what the experts loaded dequantised
compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.kernels import triton_enabled
from deepinfer.layers.batch_invariant import batch_invariant_enabled

# Padded batched GEMM is used while padding costs at most this factor in FLOPs.
MAX_PADDING_WASTE = 2.0


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up over the concatenated [gate | up] projection; V4 clamps both (limit > 0)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertQuant:
    """How a stacked expert weight is stored: kind "fp8" | "mxfp4" | "int4", its scale (the module's scale parameter
    itself, so device moves keep it current) and the FP8 (rows, cols) block (ignored by MXFP4)."""

    kind: str
    scale: torch.Tensor
    block: tuple[int, int] = (128, 128)  # int4: (1, group); its `scale` holds float16 (scale, zero) pairs


def _int4_float(w: torch.Tensor, q: ExpertQuant, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float [E, N, K] of packed int4 experts; with `rows`, only those experts are dequantised (the rest zero)."""
    from deepinfer.layers.int4_linear import dequantize_packed

    if rows is None:
        return dequantize_packed(w, q.scale, q.block[1], dtype)
    out = torch.zeros(w.shape[0], w.shape[1], 2 * w.shape[2], dtype=dtype, device=w.device)
    out[rows] = dequantize_packed(w[rows], q.scale[rows], q.block[1], dtype)
    return out


def _int4_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, q13: ExpertQuant, q2: ExpertQuant, limit: float) -> torch.Tensor:
    """Packed int4 experts (AWQ) without the fused kernels: dequantised per call, then the float path on the same
    [E, N, K] shapes (so the same values as experts loaded dequantised). Eager off CUDA only the experts the batch
    routes to are dequantised; on CUDA and in compiled steps (no host sync) all of them."""
    used = None if x.is_cuda or torch.compiler.is_compiling() else torch.unique(topk_ids)
    return routed_experts(x, topk_ids, topk_weights, _int4_float(w13, q13, x.dtype, used),
                          _int4_float(w2, q2, x.dtype, used), limit)


def expert_quant(w: torch.Tensor) -> ExpertQuant | None:
    """The ExpertQuant a kept-quantised stacked weight carries; None for a float weight."""
    return getattr(w, "expert_quant", None)


def _quantized_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Kept-quantised experts: the fused kernels on CUDA, else the torch reference (dequantise, then float32)."""
    from deepinfer.kernels.fused_moe import fused_moe, fused_moe_reference

    q13, q2 = expert_quant(w13), expert_quant(w2)
    fused = triton_enabled(x) and not batch_invariant_enabled()
    if q13.kind == "int4" and not fused:
        return _int4_experts(x, topk_ids, topk_weights, w13, w2, q13, q2, limit)
    run = fused_moe if fused else fused_moe_reference
    return run(x, topk_ids, topk_weights, w13, w2, limit, q13.scale, q2.scale, q13.kind, q13.block)


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """sum_k weight_k * expert_{id_k}(x) for x [T, D], ids/weights [T, K], w13 [E, 2I, D], w2 [E, D, I].
    On CUDA the fused Triton kernels (kernels/fused_moe.py) compute it without a host sync. Weights carrying
    `expert_quant` (kept quantised) go to the quantised kernels / their torch reference."""
    if expert_quant(w13) is not None:
        return _quantized_experts(x, topk_ids, topk_weights, w13, w2, limit)
    if triton_enabled(x) and not batch_invariant_enabled():
        from deepinfer.kernels.fused_moe import fused_moe

        return fused_moe(x, topk_ids, topk_weights, w13, w2, limit)
    if torch.compiler.is_compiling():  # a compiled step: no host sync (the expert counts stay on the device)
        return traced_experts(x, topk_ids, topk_weights, w13, w2, limit)
    num_experts, k = w13.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    token_of = order // k
    out_sorted = sorted_expert_outputs(x[token_of], flat_ids[order], counts, w13, w2, limit)
    weights = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_sorted * weights)
    return out


def traced_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """routed_experts without a host sync, for compiled (traced) steps. One token (a batch-1 decode step):
    its choices' expert weights gathered, so only the chosen experts are read; more: every expert over every
    token, combined by the routing weights (each expert's weights read once). The branch is on T == 1, which
    a compiled step's shapes decide without a guard (a dynamic batch dimension is never 1)."""
    t = topk_ids.shape[0]
    if t == 1:
        h = swiglu(torch.einsum("td,tknd->tkn", x, w13[topk_ids]), limit)
        y = torch.einsum("tki,tkdi->tkd", h, w2[topk_ids])
        return (y * topk_weights.to(y.dtype)[..., None]).sum(1)
    combine = x.new_zeros(t, w13.shape[0]).scatter_add_(1, topk_ids, topk_weights.to(x.dtype))
    h = swiglu(torch.matmul(x, w13.transpose(1, 2)), limit)  # [E, T, I]
    return torch.einsum("te,etd->td", combine, torch.matmul(h, w2.transpose(1, 2)))


def sorted_expert_outputs(xs: torch.Tensor, sorted_ids: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, limit: float = 0.0,
                          plan_counts: torch.Tensor | None = None) -> torch.Tensor:
    """expert_{sorted_ids[n]}(xs[n]) for rows sorted by expert id, counts[e] rows of expert e.

    The GEMM shapes follow plan_counts (default counts), the expert counts of the whole batch: expert
    parallelism passes the counts over all ranks so a rank's GEMMs have the single-process shapes."""
    plan = (counts if plan_counts is None else plan_counts).tolist()
    if max(plan) * len(plan) <= MAX_PADDING_WASTE * sum(plan):
        return _padded_batched(xs, sorted_ids, counts, max(plan), w13, w2, limit)
    return _grouped_loop(xs, counts.tolist(), w13, w2, limit)


def _grouped_loop(xs: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                  limit: float) -> torch.Tensor:
    out = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            out[rows] = F.linear(swiglu(F.linear(xs[rows], w13[expert]), limit), w2[expert])
            start += n
    return out


def _padded_batched(xs: torch.Tensor, sorted_ids: torch.Tensor, counts: torch.Tensor, capacity: int,
                    w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Rows grouped by expert into [E, capacity, D]; padding rows are zero and never read back."""
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(sorted_ids.numel(), device=xs.device) - starts[sorted_ids]
    buf = xs.new_zeros(w13.shape[0], capacity, xs.shape[1])
    buf[sorted_ids, slot] = xs
    h = swiglu(torch.bmm(buf, w13.transpose(1, 2)), limit)
    return torch.bmm(h, w2.transpose(1, 2))[sorted_ids, slot]
