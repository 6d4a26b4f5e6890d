"""Grouped int4 weights: the AWQ (GEMM) and GPTQ tensor layouts, round-to-nearest quantisation, dequantisation.

In memory a weight is an `Int4Weight`: codes [out, in] (uint8, 0..15), zero points [out, G] (uint8, 0..15) and
scales [out, G] (float32 holding float16 values, as checkpoints store them), G = in / group;
w[o, i] = (codes[o, i] - zeros[o, i // group]) * scales[o, i // group].

Checkpoint layouts (what AutoAWQ / AutoGPTQ write and vLLM / LMDeploy read), x @ W with W [in, out]:
  * AWQ GEMM: qweight int32 [in, out / 8], qzeros int32 [G, out / 8], scales float16 [G, out]. An int32 packs
    eight consecutive outputs 8c..8c+7; its nibble j (bits 4j..4j+3) holds output 8c + AWQ_ORDER[j];
  * GPTQ: qweight int32 [in / 8, out] packs eight consecutive inputs (nibble j = input 8r + j), qzeros int32
    [G, out / 8] eight consecutive outputs in order, scales float16 [G, out], g_idx int32 [in] (the group of
    each input). v1 checkpoints ("gptq") store zero - 1, read back as stored + 1 (no wrap, as AutoGPTQ does).

Invariants: `pack_int32` / `unpack_int32` are inverse on codes 0..15; `awq_tensors(awq_weight(t)) == t` bit for
bit for any valid tensors t; every shape problem is a ValueError naming what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.quantization.spec import PACK

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a packed int32 holds output 8c + AWQ_ORDER[j]
_AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + k sits in nibble _AWQ_UNDO[k]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
MAX_CODE = 15
_MIN_RANGE = 1e-5  # a constant group still gets a positive scale (AutoAWQ's clamp)


@dataclass(frozen=True)
class Int4Weight:
    codes: torch.Tensor  # uint8 [out, in]
    zeros: torch.Tensor  # uint8 [out, G]
    scales: torch.Tensor  # float32 [out, G], float16-representable
    group: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [out, in] weight the codes stand for."""
        out, cols = self.codes.shape
        codes = self.codes.view(out, cols // self.group, self.group).to(dtype)
        w = (codes - self.zeros.to(dtype).unsqueeze(-1)) * self.scales.to(dtype).unsqueeze(-1)
        return w.view(out, cols)

    def nbytes(self) -> int:
        """Bytes of the packed form: 4 bits a code and a zero, 2 bytes a (float16) scale."""
        return self.codes.numel() // 2 + self.zeros.numel() // 2 + 2 * self.scales.numel()


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """int32 [..., n / 8] of codes [..., n] (0..15): code 8c + j in nibble j of element c."""
    if codes.shape[-1] % PACK:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes eight to an int32")
    nibbles = codes.to(torch.int64).view(*codes.shape[:-1], -1, PACK) << _SHIFTS.to(torch.int64)
    words = nibbles.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int32(words: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8 n] codes of int32 [..., n] (inverse of pack_int32)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed int4 tensors are int32, got {words.dtype}")
    codes = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & MAX_CODE
    return codes.to(torch.uint8).flatten(-2)


def _awq_unorder(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8 n] codes as unpacked from AWQ words -> in output order."""
    return codes.view(*codes.shape[:-1], -1, PACK)[..., list(_AWQ_UNDO)].flatten(-2)


def _awq_order(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(*codes.shape[:-1], -1, PACK)[..., list(AWQ_ORDER)].flatten(-2)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected {' or '.join(map(str, dtypes))} {shape}")


def _groups(scales: torch.Tensor, in_features: int, group: int) -> int:
    if in_features % group:
        raise ValueError(f"{in_features} inputs do not split into groups of {group}")
    return in_features // group


_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4Weight:
    """The Int4Weight of an AWQ GEMM triple (ValueError on any shape / dtype mismatch)."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight: expected 2-D int32 [in, out / 8], got {tuple(qweight.shape)}")
    cols, out = qweight.shape[0], qweight.shape[1] * PACK
    g = _groups(scales, cols, group)
    _check("qweight", qweight, (cols, out // PACK), (torch.int32,))
    _check("qzeros", qzeros, (g, out // PACK), (torch.int32,))
    _check("scales", scales, (g, out), _SCALE_DTYPES)
    codes = _awq_unorder(unpack_int32(qweight)).t().contiguous()
    zeros = _awq_unorder(unpack_int32(qzeros)).t().contiguous()
    return Int4Weight(codes, zeros, scales.float().t().contiguous(), group)


def awq_tensors(w: Int4Weight) -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales"} of `w` in the AWQ GEMM layout."""
    return {"qweight": pack_int32(_awq_order(w.codes.t().contiguous())),
            "qzeros": pack_int32(_awq_order(w.zeros.t().contiguous())),
            "scales": w.scales.t().contiguous().to(torch.float16)}


def _check_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> tuple[int, int]:
    """(inputs, groups) of a GPTQ triple whose shapes and dtypes fit (ValueError naming the member otherwise)."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight: expected 2-D int32 [in / 8, out], got {tuple(qweight.shape)}")
    cols, out = qweight.shape[0] * PACK, qweight.shape[1]
    g = _groups(scales, cols, group)
    _check("qweight", qweight, (cols // PACK, out), (torch.int32,))
    _check("qzeros", qzeros, (g, out // PACK), (torch.int32,))
    _check("scales", scales, (g, out), _SCALE_DTYPES)
    return cols, g


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, zeros_minus_one: bool = True) -> Int4Weight | None:
    """The Int4Weight of a GPTQ quadruple whose inputs sit in consecutive groups (no g_idx, or the trivial one);
    None for act-order checkpoints (gptq_dequantize reads those)."""
    cols = qweight.shape[0] * PACK
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols) // group):
        return None
    _check_gptq(qweight, qzeros, scales, group)
    codes = unpack_int32(qweight.t().contiguous())
    zeros = (unpack_int32(qzeros) + int(zeros_minus_one)).t().contiguous()
    return Int4Weight(codes, zeros, scales.float().t().contiguous(), group)


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    group: int, zeros_minus_one: bool = True) -> torch.Tensor:
    """float32 [out, in] of a GPTQ quadruple (g_idx None: input i is in group i // group)."""
    cols, g = _check_gptq(qweight, qzeros, scales, group)
    groups = torch.arange(cols) // group if g_idx is None else g_idx.long()
    if groups.shape != (cols,) or int(groups.min()) < 0 or int(groups.max()) >= g:
        raise ValueError(f"g_idx: expected {cols} group indices in [0, {g}), got shape {tuple(groups.shape)}")
    codes = unpack_int32(qweight.t().contiguous()).float()  # [out, in]
    zeros = unpack_int32(qzeros).float() + float(zeros_minus_one)  # [G, out]
    return (codes - zeros[groups].t()) * scales.float()[groups].t()


def quantize_int4(w: torch.Tensor, group: int, clip: torch.Tensor | None = None) -> Int4Weight:
    """Round-to-nearest asymmetric int4 of float [out, in], per group of `group` inputs; `clip` [out, G] (optional)
    bounds each group to [-clip, clip] first (AWQ's clipping). Scales are rounded to float16 before the codes are
    chosen, so the codes are nearest for the scale the checkpoint stores."""
    out, cols = w.shape
    g = _groups(w, cols, group)
    tiles = w.detach().float().view(out, g, group)
    if clip is not None:
        tiles = tiles.clamp(-clip.unsqueeze(-1), clip.unsqueeze(-1))
    lo, hi = tiles.amin(-1), tiles.amax(-1)
    scales = ((hi - lo).clamp_min(_MIN_RANGE) / MAX_CODE).half().float()
    zeros = torch.round(-lo / scales).clamp(0, MAX_CODE)
    codes = (torch.round(tiles / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, MAX_CODE)
    return Int4Weight(codes.to(torch.uint8).view(out, cols), zeros.to(torch.uint8), scales, group)
