"""Capacity model of a disaggregated DeepSeek-V4.1-Flash deployment (the reference layout: 4 prefill GPUs,
64 decode GPUs, 131,072-token context, 3 draft tokens at 75 % acceptance), from the model config and stated
kernel assumptions. Every input is a flag; the results file records them beside the outputs.

What comes from the config (benchmarks/configs/deepseek-v41-flash.json, the official V4.1-Flash config):
KV bytes per token and per-request state (engine/kv_accounting.footprint, the engine's own allocation rule),
checkpoint bytes by kind (models/v41_memory.checkpoint_bytes), active parameters and attention / indexer work
per token. What is assumed (flags): the GPU's HBM bandwidth, FP8 FLOPS, memory, the fractions of them kernels
reach, the NIC bandwidth for the KV transfer, and the price per GPU-hour.

Decode model: a verify step of B requests reads this GPU's weights once, each request's attended KV (sparse
top-k entries, the window, and the index keys the indexers score), and computes (drafts + 1) query tokens per
request; its time is the sum of the bandwidth and compute terms. B is the largest batch that meets the TPOT
target and fits the KV memory. Prefill is compute-bound at the stated MFU.

    python benchmarks/pd_capacity.py [--tpot-ms 50] [--price-per-gpu-hour 3.5] ...
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.engine.kv_accounting import _v41_row_bytes, footprint
from deepinfer.models.v41_memory import _fp4, checkpoint_bytes

HERE = Path(__file__).parent
HIT_SWEEP = (0.0, 0.5, 0.9, 0.95, 0.99)  # agentic / multi-turn traffic re-sends long shared prefixes


@dataclass(frozen=True)
class Inputs:
    prefill_gpus: int = 4
    decode_gpus: int = 64
    context_tokens: int = 131072
    output_tokens: int = 4096  # per request; the prompt is the rest of the context
    draft_tokens: int = 3
    acceptance: float = 0.75  # per draft position, given the previous ones were accepted
    tpot_ms: float = 50.0  # the decode target
    prefix_hit_rate: float = 0.0  # fraction of prompt tokens the prefill pool finds in its prefix cache
    kv_cache_dtype: str = "fp8"  # the packed V4.1 cache (FP8 window, FP4 entries and index keys)
    # kernel / machine assumptions (an H200-class GPU)
    hbm_bytes_per_s: float = 4.8e12
    hbm_efficiency: float = 0.6
    fp8_flops: float = 1.979e15  # dense
    prefill_mfu: float = 0.4
    decode_mfu: float = 0.25
    gpu_memory_bytes: float = 141e9
    reserved_bytes: float = 12e9  # activations, workspaces, CUDA graphs, fragmentation
    nic_bytes_per_s: float = 50e9  # one 400 Gb/s RDMA NIC per GPU
    nic_efficiency: float = 0.7
    price_per_gpu_hour: float = 3.5  # USD


def tokens_per_step(k: int, alpha: float) -> float:
    """Expected tokens a verify step emits with k chained drafts accepted with probability alpha each."""
    return sum(alpha ** i for i in range(k + 1))


def active_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies (attention projections, the routed top-k + shared experts, the head)."""
    d, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank * heads * hd + d * hd + heads * hd * cfg.o_lora_rank
    attn += cfg.o_groups * cfg.o_lora_rank * d
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * d * cfg.moe_intermediate_size
    return cfg.num_layers * (attn + experts) + cfg.vocab_size * d


def _scored_keys(cfg: ModelConfig, layer: int, ctx: int) -> int:
    """Index keys the layer's indexer scores for one query at context ctx (0: no indexer of its own)."""
    v41 = cfg.v41
    if layer not in v41.index_source_layers:
        return 0
    keys = ctx // cfg.compress_ratios[v41.kv_source_of(layer)]
    if v41.uses_candidates(layer):
        keys = min(keys, v41.candidate_topk_blocks * v41.candidate_block_size)
    return keys


def attention_flops(cfg: ModelConfig, ctx: int) -> float:
    """Per query token: scores and values over top-k compressed entries and the window (K is V), indexers."""
    total = 0.0
    for layer, ratio in enumerate(cfg.compress_ratios):
        attended = cfg.sliding_window + (min(cfg.index_topk, ctx // ratio) if ratio else 0)
        total += 2 * 2 * cfg.num_heads * cfg.head_dim * attended
        total += 2 * cfg.index_n_heads * cfg.index_head_dim * _scored_keys(cfg, layer, ctx)
    return total


def kv_read_bytes(cfg: ModelConfig, ctx: int) -> float:
    """Per request per decode step: the cache rows its attention and indexers read (packed formats)."""
    entry = _v41_row_bytes(cfg.head_dim, "fp4_e4m3", True)
    window = _v41_row_bytes(cfg.head_dim, "fp8", True)
    key = _v41_row_bytes(cfg.index_head_dim, "fp4", True)
    total = 0.0
    for layer, ratio in enumerate(cfg.compress_ratios):
        total += cfg.sliding_window * window + (min(cfg.index_topk, ctx // ratio) * entry if ratio else 0)
        total += _scored_keys(cfg, layer, ctx) * key
    return total


def weights_per_decode_gpu(cfg: ModelConfig, gpus: int) -> float:
    """Routed experts spread over the GPUs (wide EP); everything else replicated (DP attention). Engram's
    tables stay in host memory (memory-mapped), so only their rows per step cross PCIe."""
    parts = checkpoint_bytes(cfg)
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    experts = cfg.num_layers * cfg.n_routed_experts * 3 * _fp4(inter, d)
    return parts["backbone"] - experts + experts / gpus + parts["dspark"]


def model(cfg: ModelConfig, x: Inputs) -> dict:
    fp = footprint(cfg, torch.bfloat16, x.kv_cache_dtype)
    prompt = x.context_tokens - x.output_tokens
    per_token_flops = 2 * active_params(cfg)
    hbm, nic = x.hbm_bytes_per_s * x.hbm_efficiency, x.nic_bytes_per_s * x.nic_efficiency
    # prefill: compute-bound, attention at the average position of the prompt
    prefill_flops = prompt * (per_token_flops + attention_flops(cfg, prompt // 2))
    prefill_tps = x.fp8_flops * x.prefill_mfu / (prefill_flops / prompt)  # computed tokens per second
    computed = prompt * (1 - x.prefix_hit_rate)
    transfer_bytes = prompt * fp.bytes_per_token + fp.bytes_per_sequence
    # decode: one verify step of B requests, at the average context of a request's decode
    ctx = prompt + x.output_tokens // 2
    weights = weights_per_decode_gpu(cfg, x.decode_gpus)
    fixed_s = weights / hbm
    per_request_s = kv_read_bytes(cfg, ctx) / hbm + (x.draft_tokens + 1) * (
        per_token_flops + attention_flops(cfg, ctx)) / (x.fp8_flops * x.decode_mfu)
    emitted = tokens_per_step(x.draft_tokens, x.acceptance)
    step_budget = x.tpot_ms / 1000 * emitted
    batch_tpot = max(int((step_budget - fixed_s) / per_request_s), 0)
    kv_room = x.gpu_memory_bytes - x.reserved_bytes - weights
    batch_memory = int(kv_room // (x.context_tokens * fp.bytes_per_token + fp.bytes_per_sequence))
    batch = min(batch_tpot, batch_memory)
    step_s = fixed_s + batch * per_request_s
    decode_tps = batch * emitted / step_s if batch else 0.0
    prefill_rps = x.prefill_gpus * prefill_tps / computed
    decode_rps = x.decode_gpus * decode_tps / x.output_tokens
    rps = min(prefill_rps, decode_rps)
    out_tps = rps * x.output_tokens
    gpus = x.prefill_gpus + x.decode_gpus
    return {
        "kv_bytes_per_token": fp.bytes_per_token, "state_bytes_per_request": fp.bytes_per_sequence,
        "prompt_tokens": prompt, "transfer_mb_per_request": transfer_bytes / 1e6,
        "transfer_ms_per_request": 1000 * transfer_bytes / (nic * x.prefill_gpus),
        "active_params_b": active_params(cfg) / 1e9, "prefill_gflop_per_token": prefill_flops / prompt / 1e9,
        "prefill_tokens_per_s_per_gpu": prefill_tps,
        "prefill_s_per_request_on_pool": computed / (prefill_tps * x.prefill_gpus),
        "decode_weight_gb_per_gpu": weights / 1e9, "decode_kv_mb_read_per_request_step": kv_read_bytes(cfg, ctx) / 1e6,
        "tokens_per_verify_step": emitted, "decode_batch_tpot_bound": batch_tpot,
        "decode_batch_memory_bound": batch_memory, "decode_batch_per_gpu": batch,
        "decode_step_ms": 1000 * step_s, "tpot_ms": 1000 * step_s / emitted if batch else None,
        "decode_tokens_per_s_per_gpu": decode_tps, "prefill_requests_per_s": prefill_rps,
        "decode_requests_per_s": decode_rps, "bound_by": "prefill" if prefill_rps < decode_rps else "decode",
        "balanced_decode_gpus": prefill_rps * x.output_tokens / decode_tps if decode_tps else None,
        "output_tokens_per_s": out_tps, "output_tokens_per_s_per_gpu": out_tps / gpus,
        "usd_per_million_output_tokens": x.price_per_gpu_hour * gpus / 3600 / out_tps * 1e6 if out_tps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(Inputs()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--config", default=str(HERE / "configs" / "deepseek-v41-flash.json"))
    args = vars(parser.parse_args())
    cfg = ModelConfig.from_dict(json.loads(Path(args.pop("config")).read_text()))
    inputs = Inputs(**args)
    result = {"inputs": asdict(inputs), "outputs": model(cfg, inputs),
              "prefix_hit_sweep": [{"prefix_hit_rate": h, **model(cfg, replace(inputs, prefix_hit_rate=h))}
                                   for h in HIT_SWEEP]}
    out = HERE / "results" / "pd_capacity.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result["outputs"].items():
        print(f"{key:40s} {value:,.3f}" if isinstance(value, float) else f"{key:40s} {value}")
    print("prefix hit rate -> requests/s (bound), output tokens/s per GPU, USD per 1M output tokens")
    for row in result["prefix_hit_sweep"]:
        rps = row["output_tokens_per_s"] / inputs.output_tokens
        print(f"  {row['prefix_hit_rate']:.2f} -> {rps:.2f} ({row['bound_by']}), "
              f"{row['output_tokens_per_s_per_gpu']:.0f}, {row['usd_per_million_output_tokens']:.2f}")
    print("wrote", out)


if __name__ == "__main__":
    main()
