"""DeepSeek-V3 / V2 (MLA) parity with transformers over a paged cache, plus checkpoint loading.

Every request maps its logical blocks to shuffled physical blocks of a NaN-filled pool, so a read of
an unwritten or foreign slot shows up as NaN or as a logit mismatch.
"""

from __future__ import annotations

import pytest
import torch
from paged_mla import PagedRun
from safetensors.torch import load_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM as MLAModel
from deepinfer.models.loader import CheckpointError

TOL = 1e-4

V3_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=10240, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
# V2: softmax routing limited to the 2 best of 4 groups; YaRN whose cos/sin factor is not 1.
V2_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=2,
    num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
    routed_scaling_factor=16.0, norm_topk_prob=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.8},
    max_position_embeddings=10240, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
# V2-Lite: no q compression (q_proj), greedy routing, plain RoPE.
V2_LITE_TINY = {**V2_TINY, "q_lora_rank": None, "topk_method": "greedy", "n_group": None,
                "topk_group": None, "routed_scaling_factor": 1.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

CASES = {
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, V3_TINY),
    "v3_rope_halves": (DeepseekV3Config, DeepseekV3ForCausalLM, {**V3_TINY, "rope_interleave": False}),
    "v2": (DeepseekV2Config, DeepseekV2ForCausalLM, V2_TINY),
    "v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, V2_LITE_TINY),
}


def _make_hf(case: str, seed: int = 0):
    config_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "eager"
    hf = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in hf.modules():
            bias = getattr(mod, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.01 * torch.randn(bias.shape, generator=g))
    hf.generation_config.eos_token_id = None  # greedy runs always produce max_new_tokens
    return hf


def _checkpoint(path) -> list[tuple[str, torch.Tensor, str]]:
    return [(k, v, "model.safetensors") for k, v in load_file(path / "model.safetensors").items()]


def _load(path, weights=None) -> MLAModel:
    model = MLAModel(ModelConfig.from_hf(path))
    model.load_weights(weights if weights is not None else _checkpoint(path))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = _make_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, _load(path), path


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- parity


def test_config_matches_transformers(pair):
    hf, model, _ = pair
    attn, rotary = hf.model.layers[0].self_attn, hf.model.rotary_emb
    assert model.config.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert (model.config.rope.attention_factor or 1.0) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    torch.testing.assert_close(model.rotary.inv_freq, rotary.inv_freq, rtol=0, atol=0)


def test_router_matches_transformers(pair):
    hf, model, _ = pair
    x = 3.0 * torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, ref_w, ref_ids = hf.model.layers[1].mlp.gate(x)
        ids, w = model.model.layers[1].mlp.gate(x)
    ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ref_ids.gather(1, ref_order), ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)


def test_ragged_prefill_matches_transformers(pair):
    hf, model, _ = pair
    prompts = [_prompt(9, 1), _prompt(14, 2)]
    outs = PagedRun(model).step(list(enumerate(prompts)))
    for p, out in zip(prompts, outs):
        assert _max_diff(out, _hf_logits(hf, p)) < TOL


def test_greedy_decode_matches_transformers(pair):
    hf, model, _ = pair
    prompts, steps = [_prompt(7, 3), _prompt(12, 4)], 20
    run = PagedRun(model, seed=1)
    step_logits = [[out[-1]] for out in run.step(list(enumerate(prompts)))]
    generated: list[list[int]] = [[], []]
    for _ in range(steps):
        for r in range(2):
            generated[r].append(int(step_logits[r][-1].argmax()))
        for r, out in enumerate(run.step([(r, [generated[r][-1]]) for r in range(2)])):
            step_logits[r].append(out[-1])
    for r, p in enumerate(prompts):
        ref = _hf_logits(hf, p + generated[r])[len(p) - 1:]
        assert _max_diff(torch.stack(step_logits[r]), ref) < TOL
        with torch.no_grad():
            hf_tokens = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, pad_token_id=2)
        assert hf_tokens[0, len(p):].tolist() == generated[r]


def test_chunked_prefill_mixed_with_decode(pair):
    """Chunks 3, 5, rest of one prompt while another request prefills and then decodes alongside."""
    hf, model, _ = pair
    a, b = _prompt(14, 5), _prompt(7, 6)
    run = PagedRun(model, seed=2)
    a_out, b_out = run.step([(0, a[:3]), (1, b)])
    b_next = [int(b_out[-1].argmax())]
    b_steps = [b_out[-1]]
    for chunk in (a[3:8], a[8:]):
        b_last, a_chunk = run.step([(1, b_next[-1:]), (0, chunk)])
        a_out = torch.cat([a_out, a_chunk])
        b_steps.append(b_last[-1])
        b_next.append(int(b_last[-1].argmax()))
    assert _max_diff(a_out, _hf_logits(hf, a)) < TOL
    ref_b = _hf_logits(hf, b + b_next[:-1])[len(b) - 1:]
    assert _max_diff(torch.stack(b_steps), ref_b) < TOL


def test_decode_matches_prefill_of_same_tokens(pair):
    """Token-by-token decode (absorbed) and one prefill (expanded) of the same sequence agree."""
    _, model, _ = pair
    seq = _prompt(11, 7)
    run = PagedRun(model, seed=3)
    stepwise = [run.step([(0, seq[:1])])[0][-1]] + [run.step([(0, [t])])[0][-1] for t in seq[1:]]
    whole = PagedRun(model, seed=4).step([(0, seq)])[0]
    assert _max_diff(torch.stack(stepwise), whole) < 1e-5


# ---------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3_ckpt")
    _make_hf("v3").save_pretrained(path)
    return path


def test_state_dict_uses_checkpoint_names(pair):
    _, model, path = pair
    ckpt = {name: t for name, t, _ in _checkpoint(path)}
    dense = {n for n in ckpt if ".mlp.experts." not in n}
    ours = model.state_dict()
    assert {n for n in ours if ".mlp.experts." not in n} == dense
    pre = "model.layers.1.mlp.experts"
    gate, up, down = (ckpt[f"{pre}.5.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(ours[f"{pre}.w13"][5], torch.cat([gate, up]))
    assert torch.equal(ours[f"{pre}.w2"][5], down)


def _fused_experts(per_expert: dict[str, torch.Tensor], pre: str) -> list[tuple[str, torch.Tensor, str]]:
    """transformers' in-memory layout: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""
    names = ("gate_proj", "up_proj", "down_proj")
    part = {p: [per_expert[f"{pre}.{e}.{p}.weight"] for e in range(8)] for p in names}
    gate_up = torch.cat([torch.stack(part["gate_proj"]), torch.stack(part["up_proj"])], dim=1)
    return [(f"{pre}.gate_up_proj", gate_up, "x"), (f"{pre}.down_proj", torch.stack(part["down_proj"]), "x")]


def test_fused_expert_tensors_load(v3_dir):
    weights = _checkpoint(v3_dir)
    per_expert = {n: t for n, t, _ in weights if ".mlp.experts." in n}
    fused = [(n, t, s) for n, t, s in weights if ".mlp.experts." not in n]
    for layer in (1, 2):
        fused += _fused_experts(per_expert, f"model.layers.{layer}.mlp.experts")
    a, b = _load(v3_dir).state_dict(), _load(v3_dir, fused).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_mtp_tensors_are_kept(v3_dir):
    extra = [("model.layers.3.eh_proj.weight", torch.ones(128, 256), "mtp.safetensors"),
             ("model.layers.3.mlp.experts.0.up_proj.weight", torch.ones(64, 128), "mtp.safetensors")]
    model = _load(v3_dir, _checkpoint(v3_dir) + extra)
    assert set(model.mtp_weights) == {n for n, _, _ in extra}
    beyond = [("model.layers.4.eh_proj.weight", torch.ones(1), "mtp.safetensors")]
    with pytest.raises(CheckpointError, match="model.layers.4.eh_proj.weight"):
        _load(v3_dir, _checkpoint(v3_dir) + beyond)


def test_checkpoint_errors_name_file_and_tensor(v3_dir):
    weights = _checkpoint(v3_dir)
    with pytest.raises(CheckpointError, match=r"shard-7\.safetensors.*model\.layers\.0\.self_attn\.bogus"):
        _load(v3_dir, weights + [("model.layers.0.self_attn.bogus", torch.ones(1), "shard-7.safetensors")])
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.0\.mlp\.experts\.0\.up_proj"):
        _load(v3_dir, weights + [("model.layers.0.mlp.experts.0.up_proj.weight", torch.ones(1), "s")])
    bad = [(n, t[:-1] if n == "model.norm.weight" else t, s) for n, t, s in weights]
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(127,\).*\(128,\)"):
        _load(v3_dir, bad)
    dropped = ("lm_head.weight", "model.layers.2.mlp.experts.3.up_proj.weight")
    partial = [w for w in weights if w[0] not in dropped]
    with pytest.raises(CheckpointError, match=r"missing 2 .*lm_head\.weight, .*experts\.3\.up_proj\.weight"):
        _load(v3_dir, partial)


def test_kv_cache_spec(v3_dir):
    specs = _load(v3_dir).kv_cache_spec(16)
    assert [s.name for s in specs] == ["layers.0.mla", "layers.1.mla", "layers.2.mla"]
    assert all(s.kind == "paged" and s.shape == (16, 32 + 16) and s.dtype == torch.float32 for s in specs)
