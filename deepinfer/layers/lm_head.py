"""The LM head's GEMM: logits = x @ W^T with W [V, D] (or a TP rank's vocab rows of it).

A decode step on CPU computes the logits of a few rows against the whole table, read once per step and
mostly not in cache by then. BLAS reads a tall row-major W at well under its streaming speed for so few rows;
kernels/cpu's rows_linear streams it (docs/performance.md, "The LM head on CPU"). Dispatch rule: the kernel for
at most cpu_kernels.ROWS_LINEAR_MAX_ROWS rows of a 2-D float32 input and weight on CPU when the kernels are loaded,
never under autograd or batch-invariant mode; F.linear otherwise. Both compute each element as one float32 dot, in
different orders (logits agree to float32 rounding). bfloat16 stays with oneDNN: dtype="auto" picks it only where
the CPU computes in bf16 natively, and the kernel's per-element conversion was never measured against that."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import cpu_kernels
from deepinfer.layers.batch_invariant import batch_invariant_enabled


def logits_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ weight [V, D]^T, in x's dtype."""
    return cpu_kernels.rows_linear(x, weight) if rows_kernel_serves(x, weight) else F.linear(x, weight)


def rows_kernel_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= cpu_kernels.ROWS_LINEAR_MAX_ROWS
            and x.dtype == weight.dtype == torch.float32 and cpu_kernels.available() and not batch_invariant_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class LMHead(nn.Linear):
    """A bias-free nn.Linear (same parameter, same hooks) whose product is logits_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_linear(x, self.weight)
