"""Rotary position embeddings: plain and YaRN frequencies, interleaved-pair rotation."""

from __future__ import annotations

import math

import torch

from deepinfer.config import RopeConfig


def inv_frequencies(rope: RopeConfig) -> torch.Tensor:
    """[dim // 2] inverse frequencies; YaRN blends interpolated and extrapolated ones."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    if not rope.is_yarn:
        return extrapolated
    interpolated = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RotaryTable:
    """cos/sin lookup for one RopeConfig; positions index rows. Grows on demand."""

    def __init__(self, rope: RopeConfig, max_position: int, device: torch.device | str = "cpu"):
        self.rope = rope
        self.inv_freq = inv_frequencies(rope).to(device)
        self.frozen = False  # reserve()d: the tables never move again (CUDA graphs hold their addresses)
        self._build(max(max_position, 1))

    def reserve(self, max_position: int) -> None:
        """Cover positions < max_position now and never regrow (captured graphs read these tensors)."""
        if max_position > self.cos.shape[0]:
            self._build(max_position)
        self.frozen = True

    def _build(self, n: int) -> None:
        freqs = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq
        scale = self.rope.attention_factor or 1.0
        self.cos, self.sin = freqs.cos() * scale, freqs.sin() * scale

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, dim // 2] cos and sin for each position."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            if self.frozen:
                raise RuntimeError(f"position {int(positions.max())} is past the reserved rope table "
                                   f"({self.cos.shape[0]} rows)")
            self._build(2 * int(positions.max()) + 1)
        return self.cos[positions], self.sin[positions]


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [..., N, (H,) dim] keeping the interleaved layout.

    cos/sin are [N, dim // 2]; x may carry a head axis between N and dim.
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + dim/2) of x [N, (H,) dim] (half-split RoPE); cos/sin [N, dim // 2]."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotation of the trailing rope slice of x; leading (nope) channels untouched."""
    rope_dim = 2 * cos.shape[-1]
    return torch.cat([x[..., :-rope_dim], rotate_interleaved(x[..., -rope_dim:], cos, sin)], dim=-1)


def complex_rotations(rope: RopeConfig, n: int) -> torch.Tensor:
    """[n, dim / 2] complex64 e^(i p f) for positions p < n, as DeepSeek-V4.1's reference builds its table:
    frequencies base^(-2i/dim), with YaRN (when the rope has an original length) dividing the long-wavelength
    ones by `factor` and ramping linearly across the beta_fast..beta_slow band."""
    dim, base = rope.dim, rope.theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.original_max_position > 0 and rope.factor != 1.0:
        def band_edge(rotations: float) -> float:
            return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(band_edge(rope.beta_fast)), 0)
        high = min(math.ceil(band_edge(rope.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / rope.factor * (1 - keep) + freqs * keep
    angles = torch.outer(torch.arange(n), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate_tail_complex(x: torch.Tensor, rotations: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [N, (H,) D] with its last 2 * rotations.shape[-1] channels rotated as adjacent (real, imag) pairs by
    rotations [N, r] (complex; conjugated when `inverse`), the product rounded once to x's dtype."""
    width = 2 * rotations.shape[-1]
    rot = rotations.conj() if inverse else rotations
    while rot.dim() < x.dim():
        rot = rot.unsqueeze(-2)
    tail = torch.view_as_real(torch.view_as_complex(x[..., -width:].float().unflatten(-1, (-1, 2))) * rot)
    return torch.cat([x[..., :-width], tail.flatten(-2).to(x.dtype)], dim=-1)
