"""DeepSeek-V4-Flash (and V3 / R1 for comparison) on 8 x H200: weight and KV bytes per GPU, KV tokens that fit,
and routed-expert dispatch + combine bytes, computed by deepinfer/distributed/deployment.py from the config.

No checkpoint is read: the configs below are the documented sizes (V4-Flash from the reference notes on DeepSeek
architectures, "Sizes (Flash)"; V3 from the same notes plus DeepSeek-V3's published config.json for the dense
intermediate size 18432, which the notes do not list). Prints the tables docs/parallelism.md quotes and writes
benchmarks/results/parallel_model.json.

    python benchmarks/parallel_model.py
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.config import ModelConfig, ParallelConfig
from deepinfer.distributed import deployment as dep

RESULTS = Path(__file__).parent / "results"
GiB, MiB = 2**30, 2**20
RESERVE = 10 * GiB  # activations, CUDA graphs, NCCL / EP buffers, allocator slack (assumed, per GPU)
CONTEXT = 131072  # context length for the "sequences that fit" column
SEQS_PER_GPU = (64, 256)  # decode batch per GPU (one token per sequence per step, no speculation)

V4_FLASH = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_hash_layers": 3, "hc_mult": 4, "num_nextn_predict_layers": 1,
    # layers 0-1 sliding, 2-42 alternate CSA (4) and HCA (128), last entry the (sliding) MTP layer
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
}

V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}

LAYOUTS = {
    "DP8 x TP1 + EP8": ParallelConfig(8, 1, True),
    "DP1 x TP8 + EP8": ParallelConfig(1, 8, True),
    "DP1 x TP8 (experts TP-split)": ParallelConfig(1, 8, False),
    "DP2 x TP4 + EP8": ParallelConfig(2, 4, True),
    "1 GPU": ParallelConfig(1, 1, False),
}
MODELS = {"DeepSeek-V4-Flash": (V4_FLASH, dep.V4_CHECKPOINT), "DeepSeek-V3 / R1": (V3, dep.V3_CHECKPOINT)}


def gib(x: float) -> float:
    return round(x / GiB, 2)


def params_table(cfg: ModelConfig, shipped: dep.WeightFormat) -> dict:
    counts, bf16, ckpt = dep.param_counts(cfg), dep.weight_bytes(cfg, dep.BF16), dep.weight_bytes(cfg, shipped)
    kinds = {k: {"params_B": round(counts[k] / 1e9, 3), "bf16_GiB": gib(bf16[k]), f"{shipped.name}_GiB": gib(ckpt[k])}
             for k in dep.KINDS}
    return {"by_kind": kinds, "total_params_B": round(dep.total_params(cfg) / 1e9, 2),
            "total_with_mtp_B": round(dep.total_params(cfg, include_mtp=True) / 1e9, 2),
            "active_params_B": round(dep.active_params(cfg) / 1e9, 2)}


def plan_row(cfg: ModelConfig, parallel: ParallelConfig, fmt: dep.WeightFormat, kv: str) -> dict:
    plan = dep.gpu_plan(cfg, parallel, fmt, kv, reserve_bytes=RESERVE)
    fp = dep.kv_per_gpu(cfg, kv)
    row = {"weights": fmt.name, "kv_cache_dtype": kv, "weights_GiB": gib(plan.weights_bytes),
           "fits": plan.fits, "kv_budget_GiB": gib(plan.kv_budget_bytes),
           "kv_bytes_per_token": round(plan.kv_bytes_per_token, 1),
           "state_MiB_per_request": round(plan.state_bytes_per_request / MiB, 2),
           "kv_tokens_per_gpu": plan.kv_tokens, "kv_tokens_layout": dep.distinct_kv_tokens(plan, parallel),
           # a TP group holds its replica's sequences on every rank: the layout serves D x a GPU's share
           f"seqs_at_{CONTEXT}_layout": fp.max_sequences(CONTEXT, max(plan.kv_budget_bytes, 0))
           * parallel.data_parallel_size}
    if not plan.fits:
        row["short_by_GiB"] = gib(-plan.kv_budget_bytes)
        row["weights_over_hbm_GiB"] = gib(plan.weights_bytes - dep.H200_HBM_BYTES)
    return row


def moe_row(cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    row = {}
    for kind in ("alltoall", "allgather"):
        row[f"{kind}_B_per_token_layer"] = round(dep.moe_bytes_per_token(cfg, parallel, kind, SEQS_PER_GPU[0]), 1)
        for seqs in SEQS_PER_GPU:
            row[f"{kind}_MiB_per_step_{seqs}"] = round(dep.moe_bytes_per_step(cfg, parallel, kind, seqs) / MiB, 2)
    return row


def layout_rows(cfg: ModelConfig, shipped: dep.WeightFormat) -> dict:
    out = {}
    for name, parallel in LAYOUTS.items():
        plans = [plan_row(cfg, parallel, fmt, kv) for fmt in (shipped, dep.BF16) for kv in ("auto", "fp8")]
        out[name] = {"plans": plans, "moe": moe_row(cfg, parallel)}
    return out


def model_report(raw: dict, shipped: dep.WeightFormat) -> dict:
    cfg = ModelConfig.from_dict(raw)
    return {"params": params_table(cfg, shipped), "layouts": layout_rows(cfg, shipped),
            "moe_layers": dep.num_moe_layers(cfg)}


def print_header(line: str) -> None:
    """A markdown table header and its separator row."""
    print(line)
    print("|" + "---|" * (line.count("|") - 1))


def print_report(name: str, rep: dict) -> None:
    p = rep["params"]
    print(f"\n## {name}: {p['total_params_B']} B total ({p['total_with_mtp_B']} B with MTP), "
          f"{p['active_params_B']} B active, {rep['moe_layers']} MoE layers")
    print_header("| kind | params (B) | " + " | ".join(k for k in next(iter(p["by_kind"].values())) if k != "params_B")
                 + " |")
    for kind, row in p["by_kind"].items():
        print(f"| {kind} | " + " | ".join(str(v) for v in row.values()) + " |")
    print()
    print_header("| layout | weights | KV | weights GiB/GPU | KV budget GiB | KV B/token | tokens/GPU "
                 f"| tokens (layout) | seqs@{CONTEXT // 1024}K (layout) |")
    for layout, body in rep["layouts"].items():
        for r in body["plans"]:
            print(f"| {layout} | {r['weights']} | {r['kv_cache_dtype']} | {r['weights_GiB']} | {r['kv_budget_GiB']} | "
                  f"{r['kv_bytes_per_token']} | {r['kv_tokens_per_gpu']:,} | {r['kv_tokens_layout']:,} | "
                  f"{r[f'seqs_at_{CONTEXT}_layout']} |")
    print()
    print_header(f"| layout | a2a B/token/layer | a2a MiB/step @{SEQS_PER_GPU[0]} | @{SEQS_PER_GPU[1]} | "
                 f"allgather B/token/layer | allgather MiB/step @{SEQS_PER_GPU[0]} | @{SEQS_PER_GPU[1]} |")
    for layout, body in rep["layouts"].items():
        m, (a, b) = body["moe"], SEQS_PER_GPU
        print(f"| {layout} | {m['alltoall_B_per_token_layer']} | {m[f'alltoall_MiB_per_step_{a}']} | "
              f"{m[f'alltoall_MiB_per_step_{b}']} | {m['allgather_B_per_token_layer']} | "
              f"{m[f'allgather_MiB_per_step_{a}']} | {m[f'allgather_MiB_per_step_{b}']} |")


ASSUMPTIONS = {
    "hbm_bytes_per_gpu": dep.H200_HBM_BYTES, "hbm_GiB_per_gpu": gib(dep.H200_HBM_BYTES),
    "reserve_GiB_per_gpu": RESERVE / GiB, "context_for_seqs": CONTEXT,
    "weights": "shipped: V4 FP8 e4m3 projections + FP4 e2m1 routed experts with ue8m0 block scales, V3 FP8 with "
               "fp32 block scales; bf16: every projection and expert in bf16. Both: embedding, head and V4 "
               "compressor / indexer projections 16-bit; norms, routers, sinks, ape, mHC float32.",
    "placement": "routed experts (main + MTP) split over EP = world, or over TP without EP; head / vocabulary / "
                 "intermediate-parallel projections split over TP; the rest replicated per GPU (busiest rank shown)",
    "kv": "main layers only (MTP cache left out); one KV head / latent: TP ranks of a replica hold the same KV; "
          "tokens (layout) = tokens/GPU x DP; auto = bf16",
    "moe": "moe_comm.bytes_moved payload received per GPU, own-rank chunks included, bf16 activations, int32 ids, "
           "fp32 weights; decode: one token per sequence, every GPU the same number of sequences",
}


def main() -> None:
    report = {"assumptions": ASSUMPTIONS, "models": {n: model_report(raw, f) for n, (raw, f) in MODELS.items()}}
    for name, rep in report["models"].items():
        print_report(name, rep)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel_model.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
