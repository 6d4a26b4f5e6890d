"""KV-cache arithmetic from a ModelConfig alone (no weights): bytes per token of the paged pools, bytes of
a request's bounded state, and how many sequences of a given length fit a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import CSA, HCA, ModelConfig

_SCALE_BYTES = 4  # one float32 scale per stored entry when quantised


@dataclass(frozen=True)
class KVFootprint:
    bytes_per_token: float  # paged (shareable) state
    bytes_per_sequence: int  # bounded per-request state (V4 window and compressor rings)

    def max_sequences(self, context_len: int, budget_bytes: int) -> int:
        return int(budget_bytes // (self.bytes_per_sequence + context_len * self.bytes_per_token))


def _entry_bytes(width: int, element: int, quantised: bool) -> int:
    return width * element + (_SCALE_BYTES if quantised else 0)


def footprint(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVFootprint:
    from deepinfer.layers.kv_quant import is_quantised, storage_dtype

    if cfg.is_v41:
        return _v41_footprint(cfg, kv_cache_dtype == "fp8")
    paged = storage_dtype(kv_cache_dtype, dtype)
    element, quantised = torch.empty((), dtype=paged).element_size(), is_quantised(paged)
    if not cfg.is_v4:
        per_token = cfg.num_layers * _entry_bytes(cfg.kv_lora_rank + cfg.qk_rope_head_dim, element, quantised)
        if cfg.has_dsa_indexer:  # V3.2 indexer keys: model dtype, never quantised
            per_token += cfg.num_layers * cfg.index_head_dim * torch.empty((), dtype=dtype).element_size()
        return KVFootprint(per_token, 0)
    return KVFootprint(_v4_paged_per_token(cfg, element, quantised), _v4_state_per_sequence(cfg, dtype))


def _v4_paged_per_token(cfg: ModelConfig, element: int, quantised: bool) -> float:
    total = 0.0
    for kind, ratio in zip(cfg.layer_kinds, cfg.compress_ratios):
        if kind in (CSA, HCA):
            total += _entry_bytes(cfg.head_dim, element, quantised) / ratio
        if kind == CSA:
            total += _entry_bytes(cfg.index_head_dim, element, quantised) / ratio
    return total


def _v4_state_per_sequence(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Window ring (model dtype) plus float32 compressor rings of [wkv | wgate + ape] per position."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for kind, ratio in zip(cfg.layer_kinds, cfg.compress_ratios):
        total += cfg.sliding_window * cfg.head_dim * element
        if kind == CSA:
            total += 2 * ratio * 2 * (2 * cfg.head_dim) * 4 + 2 * ratio * 2 * (2 * cfg.index_head_dim) * 4
        elif kind == HCA:
            total += ratio * 2 * cfg.head_dim * 4
    return total


def _v41_row_bytes(width: int, fmt: str, packed: bool) -> int:
    from deepinfer.layers.mx_quant import packed_shapes

    return sum(packed_shapes(width, fmt)) if packed else 2 * width


def _v41_footprint(cfg: ModelConfig, packed: bool) -> KVFootprint:
    """V4.1: compressed entries + index keys only at the kv sources (1 per `ratio` tokens), bf16 or packed
    (FP4 codes + scales); per request a window ring per layer, the ratio > 1 sources' float32 projection rings
    and Engram's token ring."""
    v41 = cfg.v41
    per_token = sum((_v41_row_bytes(cfg.head_dim, "fp4_e4m3", packed) +
                     _v41_row_bytes(cfg.index_head_dim, "fp4", packed)) / cfg.compress_ratios[s]
                    for s in v41.kv_source_layers)
    state = cfg.num_layers * cfg.sliding_window * _v41_row_bytes(cfg.head_dim, "fp8", packed)
    state += sum(cfg.compress_ratios[s] * 2 * cfg.head_dim * 4 for s in v41.kv_source_layers
                 if cfg.compress_ratios[s] > 1)
    if v41.engram is not None:
        state += v41.engram.max_ngram_size * 8
    return KVFootprint(per_token, state)
