"""Deployment arithmetic: parameter counts equal the engine's instantiated tiny models, the per-GPU formulas equal
hand-computed numbers on a tiny V3 config, and the documented V4-Flash / V3 sizes land on the published totals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny_models import V2_TINY, V3_TINY, V4_TINY, V4_TINY_B

from deepinfer.config import ModelConfig, ParallelConfig
from deepinfer.distributed import deployment as dep
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.mla_mtp import MLAMTPLayer

TINY = {"v4": (V4_TINY, "deepseek_v4"), "v4b": (V4_TINY_B, "deepseek_v4"), "v3": (V3_TINY, "deepseek_v3"),
        "v2": (V2_TINY, "deepseek_v2")}
# Parameter-name rules (first match wins) mapping the engine's modules to deployment.KINDS.
_RULES = (("mtp", "mtp"), ("embed", "embedding"), ("head.weight", "embedding"), ("shared_experts", "shared_experts"),
          ("experts.", "routed_experts"), (".attn.", "attention"), ("self_attn.", "attention"),
          ("mlp.gate.", "other"), ("mlp.", "dense_mlp"))


def _cfg(kind: str) -> ModelConfig:
    raw, model_type = TINY[kind]
    return ModelConfig.from_dict({**raw, "model_type": model_type})


def _kind_of(name: str) -> str:
    return next((kind for part, kind in _RULES if part in name and not name.startswith("hc_head")), "other")


def _engine_params(cfg: ModelConfig) -> dict[str, torch.nn.Parameter]:
    """Named parameters of the engine's bf16 model; V3's MTP layers (built lazily there) as `mtp.{k}.*`."""
    if cfg.is_v4:
        return dict(DeepseekV4ForCausalLM(cfg, torch.bfloat16).named_parameters())
    params = dict(DeepseekV3ForCausalLM(cfg, torch.bfloat16).named_parameters())
    for k in range(cfg.num_mtp_layers):
        layer = MLAMTPLayer(cfg, k, torch.bfloat16, "cpu")
        params.update({f"mtp.{k}.{n}": p for n, p in layer.named_parameters()})
    return params


@pytest.mark.parametrize("kind", sorted(TINY))
def test_counts_and_bf16_bytes_equal_the_instantiated_engine_model(kind):
    cfg = _cfg(kind)
    params = _engine_params(cfg)
    by_kind = dict.fromkeys(dep.KINDS, 0)
    for name, p in params.items():
        by_kind[_kind_of(name)] += p.numel()
    assert dep.param_counts(cfg) == by_kind
    assert sum(dep.weight_bytes(cfg, dep.BF16).values()) == sum(p.numel() * p.element_size() for p in params.values())


def test_tiny_v3_counts_by_hand():
    """V3_TINY: D 128, 3 layers (layer 0 dense, 1-2 MoE), 4 heads, q_lora 64, latent 32, nope 32, rope 16, v 32,
    8 experts of 64, 1 shared, dense 256, vocab 512, 1 MTP layer."""
    attention = 128 * 64 + 64 + 64 * 4 * 48 + 128 * 48 + 32 + 32 * 4 * 64 + 4 * 32 * 128  # 51,296 per layer
    routed, shared = 3 * 8 * 64 * 128, 3 * 128 * 64
    mtp = attention + routed + shared + 8 * 128 + 2 * 128 + 2 * 128 * 128 + 3 * 128
    assert dep.param_counts(_cfg("v3")) == {
        "embedding": 2 * 512 * 128, "attention": 3 * attention, "dense_mlp": 3 * 128 * 256,
        "shared_experts": 2 * shared, "routed_experts": 2 * routed,
        "other": 3 * 2 * 128 + 128 + 2 * 8 * 128,  # layer norms, final norm, 2 routers
        "mtp": mtp}
    assert dep.total_params(_cfg("v3"), include_mtp=True) == dep.total_params(_cfg("v3")) + mtp
    assert dep.active_params(_cfg("v3")) == dep.total_params(_cfg("v3")) - 2 * routed * 6 // 8  # top-2 of 8


def test_tiny_v3_bytes_per_gpu_by_hand():
    """DP2 x TP2 + EP4 in bf16: experts / 4, head-, vocab- and intermediate-parallel tensors / 2, rest replicated."""
    cfg = _cfg("v3")
    experts = (2 + 1) * 3 * 8 * 64 * 128  # main + MTP routed experts
    split = 2 * 512 * 128 + 4 * (64 * 4 * 48 + 32 * 4 * 64 + 4 * 32 * 128) + 3 * 128 * 256 + 3 * 3 * 128 * 64
    replicated = 4 * (128 * 64 + 128 * 48) + 2 * 128 * 128  # q_a, kv_a of 3 layers + MTP, eh_proj
    fp32 = dep.total_params(cfg, include_mtp=True) - experts - split - replicated
    expected = 2 * experts / 4 + 2 * split / 2 + 2 * replicated + 4 * fp32
    assert dep.weight_bytes_per_gpu(cfg, dep.BF16, ParallelConfig(2, 2, True)) == pytest.approx(expected)
    no_ep = 2 * experts / 2 + 2 * split / 2 + 2 * replicated + 4 * fp32  # experts TP-split instead
    assert dep.weight_bytes_per_gpu(cfg, dep.BF16, ParallelConfig(2, 2, False)) == pytest.approx(no_ep)
    whole = sum(dep.weight_bytes(cfg, dep.BF16).values())
    assert dep.weight_bytes_per_gpu(cfg, dep.BF16, ParallelConfig(1, 1, False)) == pytest.approx(whole)


@pytest.mark.parametrize("experts, parallel, share", [
    (8, ParallelConfig(2, 2, True), 2 / 8), (5, ParallelConfig(2, 1, True), 3 / 5),  # busiest rank: ceil(E / EP)
    (8, ParallelConfig(1, 4, False), 1 / 4), (3, ParallelConfig(4, 1, True), 1 / 3)])
def test_expert_share_is_the_busiest_ranks(experts, parallel, share):
    cfg = ModelConfig.from_dict({**V3_TINY, "model_type": "deepseek_v3", "n_routed_experts": experts,
                                 "n_group": 1, "topk_group": 1})
    assert dep.expert_share(cfg, parallel) == pytest.approx(share)


def test_redundant_experts_add_their_weights():
    """EPLB's R extra slots: (E + R) / EP experts per rank; the plan's weights grow by R / EP experts."""
    cfg = ModelConfig.from_dict({**V3_TINY, "model_type": "deepseek_v3", "n_routed_experts": 8,
                                 "n_group": 1, "topk_group": 1})
    parallel = ParallelConfig(4, 1, True)
    assert dep.expert_share(cfg, parallel, num_redundant_experts=4) == pytest.approx(3 / 8)
    base, more = (dep.gpu_plan(cfg, parallel, dep.BF16, num_redundant_experts=r).weights_bytes for r in (0, 4))
    experts = sum(w.numel * dep.BF16.bytes_per_param(w.storage) for w in dep.weight_tensors(cfg)
                  if w.storage == dep.EXPERT)  # every MoE layer's, the MTP layer's too
    assert more - base == pytest.approx(experts / 8)  # R / EP = 1 more expert per layer on each rank


def test_kv_and_budget_by_hand():
    """MLA: (latent 32 + rope 16) x 2 B x 3 layers = 288 B per token, unchanged by the layout."""
    cfg = _cfg("v3")
    fp = dep.kv_per_gpu(cfg)
    assert (fp.bytes_per_token, fp.bytes_per_sequence) == (288, 0)
    parallel = ParallelConfig(2, 2, True)
    weights = dep.weight_bytes_per_gpu(cfg, dep.BF16, parallel)
    plan = dep.gpu_plan(cfg, parallel, dep.BF16, hbm_bytes=10**7, reserve_bytes=10**6)
    assert plan.kv_budget_bytes == int(10**7 - 10**6 - weights) and plan.fits
    assert plan.kv_tokens == plan.kv_budget_bytes // 288
    assert dep.distinct_kv_tokens(plan, parallel) == 2 * plan.kv_tokens
    short = dep.gpu_plan(cfg, parallel, dep.BF16, hbm_bytes=10**6, reserve_bytes=10**6)
    assert not short.fits and short.kv_tokens == 0 and short.kv_budget_bytes == int(-weights)


def test_moe_bytes_by_hand():
    """V3_TINY (D 128, K 2, E 8, bf16), EP 4, 10 tokens per GPU, 2 MoE layers."""
    cfg, parallel = _cfg("v3"), ParallelConfig(2, 2, True)
    # all-to-all: counts and tag 8 B x (E + 1) x world^2, then every pair out (D e + 4 id bytes) and back (D e)
    alltoall = (8 * 9 * 4 * 4 + 40 * 2 * (2 * 256 + 4)) / 40
    # all-gather: per rank world x (24 header + T (D e + 8 K) + T D e), over world x T tokens
    allgather = 4 * 4 * (24 + 10 * (256 + 16) + 10 * 256) / 40
    assert dep.moe_bytes_per_token(cfg, parallel, "alltoall", 10) == pytest.approx(alltoall)
    assert dep.moe_bytes_per_token(cfg, parallel, "allgather", 10) == pytest.approx(allgather)
    assert dep.moe_bytes_per_step(cfg, parallel, "alltoall", 10) == pytest.approx(alltoall * 10 * 2)
    assert dep.moe_bytes_per_step(cfg, ParallelConfig(2, 2, False), "alltoall", 10) == 0


def _documented(name: str) -> ModelConfig:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_model.py"
    spec = importlib.util.spec_from_file_location("parallel_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return ModelConfig.from_dict(getattr(module, name))


def test_v4_flash_lands_on_the_published_sizes():
    """284 B total within 1% (MTP excluded, as published; buffers such as tid2eid are not parameters); 13 B active
    within 10%: the published figure is rounded to a whole billion and counting the 1.06 B embedding + head or not
    moves it by 8%."""
    cfg = _documented("V4_FLASH")
    assert dep.total_params(cfg) == pytest.approx(284e9, rel=0.01)
    assert dep.active_params(cfg) == pytest.approx(13e9, rel=0.10)
    assert dep.kv_per_gpu(cfg).bytes_per_token == pytest.approx(6880)  # CSA 5,376 + indexer 1,344 + HCA 160
    assert dep.num_moe_layers(cfg) == 43


def test_v3_lands_on_the_published_sizes():
    """671 B total / 37 B active within 2% (MTP excluded; the router bias buffer is not a parameter)."""
    cfg = _documented("V3")
    assert dep.total_params(cfg) == pytest.approx(671e9, rel=0.02)
    assert dep.active_params(cfg) == pytest.approx(37e9, rel=0.02)
    assert dep.kv_per_gpu(cfg).bytes_per_token == 70272
    assert dep.num_moe_layers(cfg) == 58


def test_v4_flash_on_eight_gpus():
    """Shipped FP8 + FP4 weights: every 8-GPU layout fits, one GPU does not; DP 8 caches 8x the tokens of TP 8."""
    cfg = _documented("V4_FLASH")
    dp8, tp8 = (dep.gpu_plan(cfg, ParallelConfig(d, t, True), dep.V4_CHECKPOINT) for d, t in ((8, 1), (1, 8)))
    assert dp8.fits and tp8.fits and dp8.weights_bytes > tp8.weights_bytes
    assert dep.distinct_kv_tokens(dp8, ParallelConfig(8, 1)) > 7 * dep.distinct_kv_tokens(tp8, ParallelConfig(1, 8))
    assert not dep.gpu_plan(cfg, ParallelConfig(), dep.V4_CHECKPOINT).fits
