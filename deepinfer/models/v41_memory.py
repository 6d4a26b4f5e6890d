"""DeepSeek-V4.1 checkpoint bytes by kind, from the config alone, in the official storage formats: FP8 E4M3 with
one UE8M0 byte per 32x32 block, MXFP4 experts (half a byte per value, one UE8M0 byte per 32), Engram tables FP8
with a UE8M0 byte per 32 values of a row, the rest bf16 (fp32 where the checkpoint keeps fp32: mHC, sinks,
router biases). Used for docs/models.md's memory model; tests check it against a real checkpoint's bytes."""

from __future__ import annotations

import math

from deepinfer.config import ModelConfig


def _fp8(rows: int, cols: int) -> int:
    return rows * cols + math.ceil(rows / 32) * math.ceil(cols / 32)


def _fp4(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // 32


def _attention(cfg: ModelConfig, layer: int, ratio: int) -> int:
    d, hd, q, heads, groups = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, cfg.num_heads, cfg.o_groups
    v41 = cfg.v41
    total = _fp8(q, d) + _fp8(heads * hd, q) + _fp8(hd, d) + _fp8(groups * cfg.o_lora_rank, heads * hd // groups)
    total += _fp8(d, groups * cfg.o_lora_rank) + 4 * heads + 2 * (q + hd)  # wo_b, sink, q_norm, kv_norm
    if layer in v41.kv_source_layers:
        total += 2 * d * hd * (2 if ratio > 1 else 1) + 2 * hd  # wkv (+ wgate), norm: bf16
        total += 2 * hd * cfg.index_head_dim + 2 * cfg.index_head_dim  # index keys: wk, k_norm
    if layer in v41.index_source_layers:
        total += _fp8(cfg.index_n_heads * cfg.index_head_dim, q) + 2 * d * cfg.index_n_heads
    return total


def _moe(cfg: ModelConfig, experts: int) -> int:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    routed = experts * (2 * _fp4(inter, d) + _fp4(d, inter))
    shared = 2 * _fp8(inter, d) + _fp8(d, inter)
    return routed + shared + 2 * experts * d + 4 * experts


def _block(cfg: ModelConfig, layer: int, ratio: int, experts: int) -> int:
    n, d = cfg.hc_mult, cfg.hidden_size
    mhc = 2 * 4 * ((2 + n) * n * n * d + (2 + n) * n + 3)
    return _attention(cfg, layer, ratio) + _moe(cfg, experts) + mhc + 2 * 2 * d


def _engram(cfg: ModelConfig) -> tuple[int, int]:
    """(tables, the rest of the Engram modules)."""
    e = cfg.v41.engram
    if e is None:
        return 0, 0
    tables = sum(rows * e.head_dim + rows * e.head_dim // 32 for rows in e.num_embeddings)
    rest = len(e.layer_ids) * (_fp8(cfg.hidden_size * (cfg.hc_mult + 1), e.num_hash_columns * e.head_dim)
                               + 2 * 2 * cfg.hc_mult * cfg.hidden_size)
    return tables, rest


def _dspark(cfg: ModelConfig) -> int:
    ds, d = cfg.v41.dspark, cfg.hidden_size
    if ds is None:
        return 0
    stages = sum(_block(cfg, cfg.num_layers + k, 0, ds.n_routed_experts) for k in range(ds.num_stages))
    heads = _fp8(d, d * len(ds.target_layer_ids)) + 2 * d + 2 * d  # main_proj, main_norm, norm
    heads += 2 * 2 * cfg.vocab_size * ds.markov_rank + 2 * (d + ds.markov_rank)  # markov embed / head, confidence
    return stages + heads


def checkpoint_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of the official checkpoint by kind: backbone (embed, layers, norm, head), engram_tables, dspark."""
    tables, engram_rest = _engram(cfg)
    backbone = sum(_block(cfg, i, r, cfg.n_routed_experts) for i, r in enumerate(cfg.compress_ratios))
    backbone += 2 * 2 * cfg.vocab_size * cfg.hidden_size + 2 * cfg.hidden_size + engram_rest
    return {"backbone": backbone, "engram_tables": tables, "dspark": _dspark(cfg)}
