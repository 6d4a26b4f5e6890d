"""Deployment arithmetic from a ModelConfig alone: parameters and weight bytes by kind, weight and KV bytes per
GPU for a D x T layout with or without expert parallelism, and routed-expert dispatch + combine bytes.

Pure functions, no weights, no torch.distributed. The parameter enumeration mirrors the engine's modules
(`models/deepseek_v4.py`, `models/mtp.py`, `models/deepseek_v3.py`, `models/mla_mtp.py`) tensor by tensor;
`tests/test_deployment.py` checks it against instantiated tiny models. Buffers are not parameters and are
left out (V4 hash layers' tid2eid [vocab, K] int64: 6.2 MB per layer on V4-Flash; V3's router bias).

Placement model (what the per-GPU numbers assume):
- Routed experts (main and MTP) are split over EP = the whole world when expert parallelism is on, with
  `place_experts`' contiguous blocks (the busiest rank holds ceil(E / EP) experts); without EP over TP.
- Every other tensor lives once per DP replica: `tp_split` tensors (head-parallel projections, vocabulary-
  parallel embedding and head, intermediate-parallel dense MLP / shared experts) are divided by T, the rest
  (low-rank down projections, the single KV head, compressors, norms, routers, mHC) is replicated.
- KV: V4 has one KV head and MLA one latent, so TP does not split the cache: each rank of a replica holds
  every entry of the replica's tokens, and a token lives on one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.config import CSA, SLIDING, ModelConfig, ParallelConfig
from deepinfer.distributed.moe_comm import bytes_moved, place_experts
from deepinfer.engine.kv_accounting import KVFootprint, footprint

KINDS = ("embedding", "attention", "dense_mlp", "shared_experts", "routed_experts", "other", "mtp")
# Storage classes: PROJ = projections DeepSeek ships in FP8; EXPERT = routed experts (FP4 in V4); HALF = kept in
# 16 bits (embedding, head, compressor / indexer wkv, wgate, weights_proj); FP32 = kept in float32 by the engine
# (norms, router weight and bias, attention sinks, ape, mHC).
PROJ, EXPERT, HALF, FP32 = "proj", "expert", "half", "fp32"
H200_HBM_BYTES = 141 * 10**9  # the vendor's 141 GB, read as 10^9 bytes (the device reports about 140 GiB)


@dataclass(frozen=True)
class Weights:
    """One parameter tensor (or a group of equal role): its kind, storage class, size and TP placement."""

    kind: str
    storage: str
    numel: int
    tp_split: bool = False


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter of each storage class, block scales included."""

    name: str
    proj: float
    expert: float
    half: float = 2.0
    fp32: float = 4.0

    def bytes_per_param(self, storage: str) -> float:
        return getattr(self, storage)


BF16 = WeightFormat("bf16", 2.0, 2.0)
# V4 checkpoint: e4m3 + one ue8m0 byte per 128 x 128 block; experts e2m1 (two per byte) + one ue8m0 byte per 32.
V4_CHECKPOINT = WeightFormat("fp8+fp4", 1 + 1 / 128**2, 0.5 + 1 / 32)
# V3 checkpoint: e4m3 everywhere but the 16-bit tensors, one float32 scale_inv per 128 x 128 block.
V3_CHECKPOINT = WeightFormat("fp8", 1 + 4 / 128**2, 1 + 4 / 128**2)


# ----------------------------------------------------------------------------------------- V4 tensors


def _compressor(d: int, head_dim: int, ratio: int, overlap: bool) -> list[Weights]:
    width = head_dim * (2 if overlap else 1)
    return [Weights("attention", HALF, 2 * d * width), Weights("attention", FP32, ratio * width + head_dim)]


def _v4_attention(cfg: ModelConfig, kind: str, ratio: int) -> list[Weights]:
    d, h, hd, ql = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    out = [Weights("attention", PROJ, d * ql + d * hd),  # wq_a, wkv: replicated
           Weights("attention", PROJ, ql * h * hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d,
                   tp_split=True),  # wq_b, wo_a, wo_b: head-parallel
           Weights("attention", FP32, ql + hd),  # q_norm, kv_norm
           Weights("attention", FP32, h, tp_split=True)]  # attn_sink: per head
    if kind != SLIDING:
        out += _compressor(d, hd, ratio, kind == CSA)
    if kind == CSA:
        ih = cfg.index_n_heads
        # the engine replicates the Lightning Indexer (computed identically on every TP rank)
        out += [Weights("attention", PROJ, ql * ih * cfg.index_head_dim),  # indexer.wq_b
                Weights("attention", HALF, d * ih)]  # indexer.weights_proj
        out += _compressor(d, cfg.index_head_dim, ratio, True)
    return out


def _v4_moe(cfg: ModelConfig, is_hash: bool) -> list[Weights]:
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shared = 3 * d * i * max(cfg.n_shared_experts, 1)
    return [Weights("other", FP32, e * d + (0 if is_hash else e)),  # gate.weight (+ bias on learned layers)
            Weights("routed_experts", EXPERT, 3 * e * i * d),
            Weights("shared_experts", PROJ, shared, tp_split=True)]


def _hc(cfg: ModelConfig, rows: int, scales: int) -> Weights:
    """An mHC mixer: fn [rows, n D], base [rows], scale [scales], all float32."""
    return Weights("other", FP32, rows * cfg.hc_mult * cfg.hidden_size + rows + scales)


def _v4_block(cfg: ModelConfig, layer: int) -> list[Weights]:
    n = cfg.hc_mult
    norms_and_hc = [Weights("other", FP32, 2 * cfg.hidden_size), _hc(cfg, (2 + n) * n, 3), _hc(cfg, (2 + n) * n, 3)]
    attention = _v4_attention(cfg, cfg.layer_kinds[layer], cfg.compress_ratios[layer])
    return attention + _v4_moe(cfg, cfg.hash_layers[layer]) + norms_and_hc


def _v4_mtp(cfg: ModelConfig, k: int) -> list[Weights]:
    from deepinfer.models.mtp import mtp_block_config

    d = cfg.hidden_size
    own = [Weights("mtp", PROJ, 2 * d * d), Weights("mtp", FP32, 3 * d), _hc(cfg, cfg.hc_mult, 1)]  # e/h_proj, norms
    return [replace(w, kind="mtp") for w in _v4_block(mtp_block_config(cfg, k), 0) + own]


def _v4_tensors(cfg: ModelConfig) -> list[Weights]:
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [Weights("embedding", HALF, 2 * v * d, tp_split=True), Weights("other", FP32, d), _hc(cfg, cfg.hc_mult, 1)]
    for layer in range(cfg.num_layers):
        out += _v4_block(cfg, layer)
    for k in range(cfg.num_mtp_layers):
        out += _v4_mtp(cfg, k)
    return out


# ----------------------------------------------------------------------------------------- MLA tensors


def _mla_attention(cfg: ModelConfig) -> list[Weights]:
    d, h, ql, lat = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    q_dim = h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if ql:  # q_a_proj (replicated), q_a_layernorm, q_b_proj (head-parallel)
        q = [Weights("attention", PROJ, d * ql), Weights("attention", FP32, ql),
             Weights("attention", PROJ, ql * q_dim, tp_split=True)]
    else:
        q = [Weights("attention", PROJ, d * q_dim, tp_split=True)]
    heads = lat * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d  # kv_b_proj, o_proj
    return q + [Weights("attention", PROJ, d * (lat + cfg.qk_rope_head_dim)), Weights("attention", FP32, lat),
                Weights("attention", PROJ, heads, tp_split=True)]


def _mla_mlp(cfg: ModelConfig, layer: int) -> list[Weights]:
    from deepinfer.models.deepseek_v3 import is_moe_layer

    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    if not is_moe_layer(cfg, layer):
        return [Weights("dense_mlp", PROJ, 3 * d * cfg.intermediate_size, tp_split=True)]
    shared = [Weights("shared_experts", PROJ, 3 * d * i * cfg.n_shared_experts, tp_split=True)]
    return [Weights("other", FP32, e * d), Weights("routed_experts", EXPERT, 3 * e * i * d)] + shared


def _mla_layer(cfg: ModelConfig, layer: int) -> list[Weights]:
    return _mla_attention(cfg) + _mla_mlp(cfg, layer) + [Weights("other", FP32, 2 * cfg.hidden_size)]


def _mla_tensors(cfg: ModelConfig) -> list[Weights]:
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [Weights("embedding", HALF, 2 * v * d, tp_split=True), Weights("other", FP32, d)]
    for layer in range(cfg.num_layers):
        out += _mla_layer(cfg, layer)
    for k in range(cfg.num_mtp_layers):  # eh_proj [D, 2D], enorm, hnorm, head norm; embed and head are shared
        block = _mla_layer(cfg, cfg.num_layers + k)
        out += [replace(w, kind="mtp") for w in block] + [Weights("mtp", PROJ, 2 * d * d), Weights("mtp", FP32, 3 * d)]
    return out


# ----------------------------------------------------------------------------------------- parameters and bytes


def weight_tensors(cfg: ModelConfig) -> tuple[Weights, ...]:
    """Every parameter of the engine's model, MTP layers included (kind "mtp", storage kept)."""
    if cfg.is_v41:
        from deepinfer.config import ConfigError

        raise ConfigError("deployment planning does not cover DeepSeek-V4.1 yet (it runs on one device); its memory "
                          "model is in docs/models.md")
    return tuple(_v4_tensors(cfg) if cfg.is_v4 else _mla_tensors(cfg))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by kind (KINDS order); the values sum to the engine model's parameter count."""
    counts = dict.fromkeys(KINDS, 0)
    for w in weight_tensors(cfg):
        counts[w.kind] += w.numel
    return counts


def total_params(cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Published totals (284 B V4-Flash, 671 B V3) leave the MTP layers out."""
    counts = param_counts(cfg)
    return sum(counts.values()) - (0 if include_mtp else counts["mtp"])


def active_params(cfg: ModelConfig) -> int:
    """Main-model parameters one token runs through: everything but the E - K routed experts it skips."""
    skipped = cfg.n_routed_experts - cfg.num_experts_per_tok
    return total_params(cfg) - param_counts(cfg)["routed_experts"] * skipped // cfg.n_routed_experts


def weight_bytes(cfg: ModelConfig, fmt: WeightFormat) -> dict[str, float]:
    """Bytes by kind of the whole model in `fmt`."""
    out = dict.fromkeys(KINDS, 0.0)
    for w in weight_tensors(cfg):
        out[w.kind] += w.numel * fmt.bytes_per_param(w.storage)
    return out


def expert_share(cfg: ModelConfig, parallel: ParallelConfig, num_redundant_experts: int = 0) -> float:
    """Routed-expert weights the busiest rank holds, as a fraction of the E experts: ceil(E / EP) / E with EP
    ((E + R) / EP / E with R redundant EPLB slots), else 1 / T."""
    if not parallel.enable_expert_parallel:
        return 1 / parallel.tensor_parallel_size
    if num_redundant_experts:
        return (cfg.n_routed_experts + num_redundant_experts) / parallel.world_size / cfg.n_routed_experts
    placement = place_experts(cfg.n_routed_experts, parallel.world_size)
    return len(placement.local_experts(0)) / cfg.n_routed_experts  # rank 0 holds the most


def weight_bytes_per_gpu(cfg: ModelConfig, fmt: WeightFormat, parallel: ParallelConfig,
                         num_redundant_experts: int = 0) -> float:
    """Weight bytes on the busiest rank of the layout (with R redundant EPLB expert slots in all)."""
    share = expert_share(cfg, parallel, num_redundant_experts)
    return sum(w.numel * fmt.bytes_per_param(w.storage) * _gpu_share(w, share, parallel) for w in weight_tensors(cfg))


def _gpu_share(w: Weights, expert_share: float, parallel: ParallelConfig) -> float:
    if w.storage == EXPERT:
        return expert_share
    return 1 / parallel.tensor_parallel_size if w.tp_split else 1.0


# ----------------------------------------------------------------------------------------- KV cache


def kv_per_gpu(cfg: ModelConfig, kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16) -> KVFootprint:
    """KV bytes per token and bounded state per request on one GPU: the same for every layout (TP replicates
    the single KV head / latent). Main layers only: the MTP layers' cache (V4-Flash: one sliding window) is left
    out. `dtype` is the model's; `kv_cache_dtype` auto stores the paged pools in it."""
    return footprint(cfg, dtype, kv_cache_dtype)


def kv_budget(hbm_bytes: int, weights_bytes: float, reserve_bytes: int) -> int:
    """Bytes left for the KV cache; negative when the weights alone do not fit."""
    return int(hbm_bytes - reserve_bytes - weights_bytes)


def tokens_that_fit(fp: KVFootprint, budget_bytes: int) -> int:
    """Paged KV tokens that fit, ignoring the bounded per-request state (see KVFootprint.max_sequences)."""
    return max(int(budget_bytes // fp.bytes_per_token), 0)


# ----------------------------------------------------------------------------------------- MoE traffic


def num_moe_layers(cfg: ModelConfig) -> int:
    """Main layers with routed experts (V4: all; MLA: past first_k_dense_replace, every moe_layer_freq)."""
    if cfg.is_v4:
        return cfg.num_layers
    from deepinfer.models.deepseek_v3 import is_moe_layer

    return sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))


def moe_comm_kind(parallel: ParallelConfig, kind: str) -> str:
    """Without EP (or with a world of one) the experts are local to the TP group: no dispatch."""
    return kind if parallel.enable_expert_parallel and parallel.world_size > 1 else "local"


def moe_bytes_per_token(cfg: ModelConfig, parallel: ParallelConfig, kind: str, tokens_per_gpu: int,
                        elem_size: int = 2) -> float:
    """Dispatch + combine payload one GPU receives per token per MoE layer, every GPU with `tokens_per_gpu`
    tokens (moe_comm.bytes_moved over the EP world, divided by world x tokens; own-rank chunks included)."""
    world = parallel.world_size
    moved = bytes_moved(moe_comm_kind(parallel, kind), tokens_per_gpu, cfg.hidden_size, cfg.num_experts_per_tok,
                        world, elem_size, cfg.n_routed_experts)
    return moved / (world * tokens_per_gpu)


def moe_bytes_per_step(cfg: ModelConfig, parallel: ParallelConfig, kind: str, tokens_per_gpu: int,
                       elem_size: int = 2) -> float:
    """Payload one GPU receives in one forward of `tokens_per_gpu` tokens, over all main MoE layers."""
    per_layer = moe_bytes_per_token(cfg, parallel, kind, tokens_per_gpu, elem_size) * tokens_per_gpu
    return per_layer * num_moe_layers(cfg)


# ----------------------------------------------------------------------------------------- one layout


@dataclass(frozen=True)
class GpuPlan:
    """What one GPU of a layout holds (busiest rank) and how much KV is left for."""

    weights_bytes: float
    kv_bytes_per_token: float
    state_bytes_per_request: int
    kv_budget_bytes: int  # negative: the weights do not fit by that much
    kv_tokens: int  # paged tokens per GPU; the layout stores kv_tokens x D distinct tokens

    @property
    def fits(self) -> bool:
        return self.kv_budget_bytes > 0


def gpu_plan(cfg: ModelConfig, parallel: ParallelConfig, fmt: WeightFormat, kv_cache_dtype: str = "auto",
             hbm_bytes: int = H200_HBM_BYTES, reserve_bytes: int = 10 * 2**30,
             num_redundant_experts: int = 0) -> GpuPlan:
    """`reserve_bytes` is held back for activations, CUDA graphs, communication buffers and fragmentation;
    `num_redundant_experts` EPLB slots add their experts' weights."""
    weights = weight_bytes_per_gpu(cfg, fmt, parallel, num_redundant_experts)
    fp = kv_per_gpu(cfg, kv_cache_dtype)
    budget = kv_budget(hbm_bytes, weights, reserve_bytes)
    return GpuPlan(weights, fp.bytes_per_token, fp.bytes_per_sequence, budget, tokens_that_fit(fp, budget))


def distinct_kv_tokens(plan: GpuPlan, parallel: ParallelConfig) -> int:
    """Tokens the whole layout caches: each DP replica its own, every TP rank of a replica a copy."""
    return plan.kv_tokens * parallel.data_parallel_size
