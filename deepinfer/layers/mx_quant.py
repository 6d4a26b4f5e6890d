"""Microscaling quantise-dequantise (QDQ) and block-scaled GEMMs, with DeepSeek-V4.1's rounding points.

V4.1 was trained with these quantisation points in its forward, so a faithful forward reproduces them bit for
bit: activations entering an FP8 / MXFP4 GEMM are FP8 E4M3 per 32 with power-of-two (UE8M0) scales; the window
KV is FP8-QDQ'd; compressed KV is FP4 E2M1 per 16 with E4M3 scales; indexer q / k are FP4 per 32 with UE8M0
scales. Inputs are bf16, QDQ outputs are bf16 (every QDQ value is exactly representable in bf16).

Block-scaled GEMM: sum over K blocks of 32 (in K order, float32) of the block's dot products. Power-of-two
scales commute exactly with float32 rounding, so the GEMM runs on dequantised float32 weights and QDQ'd
float32 activations and equals the scaled-integer form bit for bit; only the K-block order is fixed.
"""

from __future__ import annotations

import torch

FP8_MAX, FP4_MAX = 448.0, 6.0
BLOCK = 32
_FP8_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)  # the kernels multiply by the fp32 reciprocal
_FP4_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between consecutive E2M1 magnitudes; at a tie round-to-nearest-even goes up to codes 2, 4, 6.
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def pow2_scale(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * inv_max)) in float32 (the UE8M0 scale of a block whose absmax is amax)."""
    x = amax.float() * inv_max
    mantissa, exponent = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, nearest-even, saturating at +-448 (a plain cast would give NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_qdq_float(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 values of bf16 `x` after FP8 E4M3 quantisation per `block` with UE8M0 scales (absmax >= 1e-4)."""
    groups = x.float().unflatten(-1, (-1, block))
    scale = pow2_scale(groups.abs().amax(dim=-1).clamp_min(1e-4), _FP8_INV).unsqueeze(-1)
    return (e4m3(groups / scale).float() * scale).flatten(-2)


def fp8_qdq(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """FP8 QDQ of a bf16 tensor, returned in bf16 (the window KV's training quantisation point)."""
    return fp8_qdq_float(x, block).to(x.dtype)


def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """y = x @ weight.T for an FP8 / MXFP4 weight (dequantised float32 [N, K]) and bf16 x [..., K]: x is FP8-QDQ'd
    per 32, each K block's product is float32 and the blocks are summed in K order. Returns x's dtype."""
    k = x.shape[-1]
    a = fp8_qdq_float(x, block).reshape(-1, k)
    acc = torch.zeros(a.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, k, block):
        acc += a[:, start:start + block] @ weight[:, start:start + block].T
    return acc.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# --- packed storage: the codes and scales a QDQ point produces, decoded back bit for bit ------------------------
_FORMATS = {"fp8": (BLOCK, 1), "fp4": (BLOCK, 2), "fp4_e4m3": (16, 2)}  # (block, values per byte)


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., d / values per byte], scales uint8 [..., d / block]) of bf16 `x` at QDQ point `fmt`:
    fp8 (E4M3, UE8M0 per 32), fp4 (E2M1 pairs, low nibble first, UE8M0 per 32), fp4_e4m3 (E2M1, E4M3 per 16)."""
    block, _ = _FORMATS[fmt]
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1)
    if fmt == "fp8":
        scale = pow2_scale(amax.clamp_min(1e-4), _FP8_INV)
        codes = e4m3(groups / scale.unsqueeze(-1)).flatten(-2).view(torch.uint8)
        return codes, scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    if fmt == "fp4_e4m3":
        scale8 = e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX)
        scale, stored = scale8.float(), scale8.view(torch.uint8)
    else:
        scale = pow2_scale(amax.clamp_min(6 * 2.0**-126), _FP4_INV)
        stored = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    v = (groups / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX).flatten(-2)
    mag = v.abs().unsqueeze(-1)
    code = (mag > _MIDS).sum(-1) + ((mag == _MIDS) & _TIE_UP).sum(-1) + 8 * torch.signbit(v)
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), stored


_E2M1_SIGNED = torch.cat([_E2M1, -_E2M1])


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """bf16 values of encode()'s output: exactly the QDQ point's result."""
    block, _ = _FORMATS[fmt]
    if fmt == "fp8":
        values = codes.view(torch.float8_e4m3fn).float()
        scale = scales.view(torch.float8_e8m0fnu).float()
    else:
        values = torch.stack([_E2M1_SIGNED[(codes & 0x0F).long()], _E2M1_SIGNED[(codes >> 4).long()]], -1).flatten(-2)
        scale = scales.view(torch.float8_e4m3fn if fmt == "fp4_e4m3" else torch.float8_e8m0fnu).float()
    return (values.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def qdq(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The QDQ point `fmt` applied to bf16 x, in bf16: the values its codes and scales stand for."""
    return fp8_qdq(x) if fmt == "fp8" else decode(*encode(x, fmt), fmt)


def packed_shapes(width: int, fmt: str) -> tuple[int, int]:
    """(code bytes, scale bytes) per stored row of `width` values."""
    block, per_byte = _FORMATS[fmt]
    return width // per_byte, width // block


class MXStore:
    """Flat rows of one cache tensor holding values after QDQ point `fmt`: bf16 values (kv_cache_dtype auto) or
    their codes + scales (fp8: 3.6x smaller for V4.1's compressed KV, bit-identical on read)."""

    def __init__(self, cache: dict[str, torch.Tensor], name: str, width: int, fmt: str):
        self.fmt, self.width = fmt, width
        scales = cache.get(f"{name}_scale")
        self.data = cache[name].view(-1, cache[name].shape[-1])
        self.scales = None if scales is None else scales.view(-1, scales.shape[-1])

    def encode(self, x: torch.Tensor):
        """What write stores for QDQ-less bf16 values x, and their QDQ'd bf16 (used by this step)."""
        if self.scales is None:
            y = qdq(x, self.fmt)
            return y, y
        codes, scales = encode(x, self.fmt)
        return (codes, scales), decode(codes, scales, self.fmt)

    def write(self, rows: torch.Tensor, stored, src: torch.Tensor | None = None) -> None:
        pick = (lambda t: t) if src is None else (lambda t: t[src])
        if self.scales is None:
            self.data[rows] = pick(stored)
        else:
            self.data[rows], self.scales[rows] = pick(stored[0]), pick(stored[1])

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return self.data[rows]
        return decode(self.data[rows], self.scales[rows], self.fmt)
