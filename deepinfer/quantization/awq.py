"""Activation-aware int4 quantisation (AWQ): per-channel scale search and per-group clipping search.

Pure tensor math on one weight and the inputs it saw during calibration; the command (quantization/quantize.py)
decides which weights get which search.

  * `search_scale(w, x, group)`: input-channel scales s [in] minimising || x W^T - x (Q(W diag(s)) diag(1/s))^T ||
    over s = mean|x|^a / mean|W~|^(1-a) (W~: W over its group's max), normalised, a on a grid, plus s = 1. The
    caller folds 1/s into whatever produces x (the weight is stored as Q(W diag(s)), and the producer's output
    rows are divided by s), so only an exact fold may use it;
  * `search_clip(w, x, group)`: per (output, group) bound c = r * max|w| for r on a grid down to 1 - max_shrink,
    minimising that group's partial-output error || x_g w_g^T - x_g Q(clamp(w_g, -c, c))^T ||, r = 1 included.

Invariant: both grids contain the identity (s = 1, r = 1), so on the calibration inputs the chosen scale's
error (over the weights searched together) and each group's chosen clipping error are never above
round-to-nearest's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.quantization.int4 import Int4Weight, quantize_int4

_FLOOR = 1e-4  # AutoAWQ's floor for the scale formula's terms


@dataclass(frozen=True)
class SearchGrid:
    scale_points: int = 20  # a = 0, 1/n, ..., (n-1)/n
    clip_points: int = 20  # r = 1, 1 - max_shrink/n, ..., 1 - max_shrink (n-1)/n
    max_shrink: float = 0.5
    clip_rows: int = 256  # calibration rows the clipping search looks at (its cost is out x in x rows)


def fake_quantize(w: torch.Tensor, group: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    return quantize_int4(w, group, clip).dequantize()


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared difference of x W^T and x W_hat^T."""
    return float(((x @ (w - w_hat).t()) ** 2).mean())


def _scale_candidates(w: torch.Tensor, x: torch.Tensor, group: int, points: int) -> list[torch.Tensor]:
    out, cols = w.shape
    tiles = w.abs().view(out, cols // group, group)
    w_mean = (tiles / tiles.amax(-1, keepdim=True).clamp_min(1e-12)).view(out, cols).mean(0)
    x_mean = x.abs().mean(0)
    found = [torch.ones(cols)]
    for i in range(points):
        a = i / points
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + _FLOOR)).clamp_min(_FLOOR)
        found.append(s / (s.max() * s.min()).sqrt())
    return found


def search_scale(w: torch.Tensor, x: torch.Tensor, group: int, grid: SearchGrid = SearchGrid()) -> torch.Tensor:
    """The input-channel scales [in] of least output error (see the module docstring); w [out, in], x [n, in]."""
    w, x = w.float(), x.float()
    best, best_err = None, float("inf")
    for s in _scale_candidates(w, x, group, grid.scale_points):
        err = output_error(w, fake_quantize(w * s, group) / s, x)
        if err < best_err:
            best, best_err = s, err
    return best


def search_clip(w: torch.Tensor, x: torch.Tensor, group: int, grid: SearchGrid = SearchGrid()) -> torch.Tensor:
    """Per-(output, group) clipping bounds [out, G] of least partial-output error; w [out, in], x [n, in]."""
    w, x = w.float(), x.float()[: grid.clip_rows]
    out, cols = w.shape
    g = cols // group
    xg = x.view(-1, g, group)
    ref = torch.einsum("ngk,ogk->ogn", xg, w.view(out, g, group))
    amax = w.abs().view(out, g, group).amax(-1)
    best, best_err = amax.clone(), torch.full((out, g), float("inf"))
    for i in range(grid.clip_points):
        clip = amax * (1 - grid.max_shrink * i / grid.clip_points)
        got = torch.einsum("ngk,ogk->ogn", xg, fake_quantize(w, group, clip).view(out, g, group))
        err = ((got - ref) ** 2).mean(-1)
        better = err < best_err
        best, best_err = torch.where(better, clip, best), torch.where(better, err, best_err)
    return best


def awq_quantize(w: torch.Tensor, x: torch.Tensor | None, group: int, grid: SearchGrid = SearchGrid()) -> Int4Weight:
    """Int4 of w [out, in] with AWQ's clipping search on inputs x (round-to-nearest when x is None or empty)."""
    if x is None or len(x) == 0:
        return quantize_int4(w, group)
    return quantize_int4(w, group, search_clip(w, x, group, grid))
