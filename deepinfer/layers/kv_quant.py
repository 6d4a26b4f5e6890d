"""Quantised paged KV pools: fp8 (e4m3) or int8 entries with one float32 scale per entry (per token for
MLA, per compressed entry for V4). `auto` stores entries in the model dtype without scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.gather import take_rows

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or int8, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_quantised(dtype: torch.dtype) -> bool:
    return dtype in _MAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax scaling: x ~= q * scale, |q| <= the format's largest finite value."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _MAX[dtype]).clamp(min=1e-12)
    q = xf / scale
    if dtype == torch.int8:
        q = q.round().clamp(-127, 127)
    return q.to(dtype), scale


@dataclass
class PagedPool:
    """One paged tensor viewed as flat rows [num_blocks * entries_per_block, width], with its scales."""

    data: torch.Tensor
    scale: torch.Tensor | None
    out_dtype: torch.dtype

    @classmethod
    def of(cls, cache: dict[str, torch.Tensor], name: str, width: int, out_dtype: torch.dtype) -> PagedPool:
        scale = cache.get(f"{name}_scale")
        return cls(cache[name].view(-1, width), None if scale is None else scale.view(-1, 1), out_dtype)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if self.scale is None:
            self.data[rows] = values.to(self.data.dtype)
            return
        q, scale = quantize(values, self.data.dtype)
        self.data[rows], self.scale[rows] = q, scale

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return take_rows(self.data, rows)
        return (take_rows(self.data, rows).float() * take_rows(self.scale, rows)).to(self.out_dtype)

    def read_blocks(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        """[R, blocks * block_size, width]: the rows of each table row's blocks, in order. One index per block
        (not per row), so a compiled gather copies whole blocks."""
        data = self.data.view(-1, block_size, self.data.shape[-1])[table].flatten(1, 2)
        if self.scale is None:
            return data
        scale = self.scale.view(-1, block_size, 1)[table].flatten(1, 2)
        return (data.float() * scale).to(self.out_dtype)
