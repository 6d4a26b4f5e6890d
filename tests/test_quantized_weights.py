"""Weights kept quantised in memory (the CUDA path, driven here through the model API on CPU).

Tiny checkpoints are written here: V3 with FP8 (32x32 float32 `weight_scale_inv`) projections and routed experts,
and MTP layer `model.layers.3.*`; V4 with FP8 (128x128, partial edge blocks) projections and FP4 routed experts
(E2M1 codes, UE8M0 `.scale` per 32 inputs), main and `mtp.0.*`. Each is loaded kept quantised and dequantised:
the logits are equal (the torch path dequantises to the very values the loader produces), the kept tensors take
the checkpoint's bytes, and with the Triton paths forced on (interpreter) the kernels match the torch path.
"""

from __future__ import annotations

import re

import pytest
import torch
from paged_mla import PagedRun
from quantize_utils import e8m0, pack_fp4
from safetensors.torch import save_file
from tiny_models import V3_TINY, V4_TINY, V32_TINY
from v4_runs import Run, official_names

import deepinfer.layers.moe as moe_module
import deepinfer.layers.quant_linear as quant_linear_module
from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts
from deepinfer.distributed.moe_comm import place_experts
from deepinfer.engine.core import KEEP_QUANTIZED_ENV, load_model
from deepinfer.layers.quant_linear import FP8BlockLinear, quantize_fp8_block
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.loader import CheckpointError, iter_checkpoint, quantized_weights
from deepinfer.models.mla_mtp import MLAMTPLayer

V3_BLOCK, V4_BLOCK = (32, 32), (128, 128)
V3_FP8 = re.compile(r".*(_proj|_mqa|indexer\.wq_b|indexer\.wk)\.weight")  # every projection, experts included
V4_EXPERT = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight")


# --- checkpoints ----------------------------------------------------------------------------------------
def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every float tensor random (norm weights near 1); V4 hash tables get valid, distinct expert ids."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(8, generator=g)[:t.shape[1]] for _ in range(t.shape[0])]))
            elif t.is_floating_point():
                noise = torch.randn(t.shape, generator=g)
                t.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)


def _v3_per_expert(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Stacked `...mlp.experts.w13 / w2` as the checkpoint's per-expert gate / up / down matrices."""
    out = {}
    for name, t in state.items():
        stem, _, leaf = name.rpartition(".")
        if stem.endswith("mlp.experts") and leaf in ("w13", "w2"):
            parts = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
            for e in range(t.shape[0]):
                out |= {f"{prefix}{stem}.{e}.{p}.weight": m for p, m in zip(parts, t[e].chunk(len(parts)))}
        else:
            out[prefix + name] = t
    return {n: t.clone().contiguous() for n, t in out.items()}


def _fp8(tensors: dict[str, torch.Tensor], pick: re.Pattern, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The picked 2-D weights as float8 + float32 `weight_scale_inv` (quantize_fp8_block), the rest as they are."""
    out = {}
    for name, t in tensors.items():
        if pick.fullmatch(name) and t.dim() == 2:
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(t, block)
        else:
            out[name] = t
    return out


def _fp4(tensors: dict[str, torch.Tensor], pick: re.Pattern, seed: int) -> dict[str, torch.Tensor]:
    """The picked [out, in] weights replaced by random E2M1 codes (int8, two a byte) + UE8M0 `.scale` per 32."""
    g, out = torch.Generator().manual_seed(seed), {}
    for name, t in tensors.items():
        if pick.fullmatch(name):
            exps = torch.randint(-7, -3, (t.shape[0], t.shape[1] // 32), generator=g)
            out[name] = pack_fp4(torch.randint(0, 16, t.shape, generator=g))
            out[name.removesuffix("weight") + "scale"] = e8m0(exps)
        else:
            out[name] = t
    return out


def _mla_ckpt(path, config):
    """A random MLA model (and its MTP layers) written with FP8 projections and experts."""
    config.save_pretrained(path)
    cfg = ModelConfig.from_hf(path)
    model = DeepseekV3ForCausalLM(cfg)
    _randomise(model, 0)
    tensors = _v3_per_expert(model.state_dict())
    for k in range(cfg.num_mtp_layers):
        mtp = MLAMTPLayer(cfg, k, torch.float32, "cpu")
        _randomise(mtp, 1 + k)
        tensors |= _v3_per_expert(mtp._targets(), f"model.layers.{cfg.num_layers + k}.")
    save_file(_fp8(tensors, V3_FP8, V3_BLOCK), path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    return _mla_ckpt(tmp_path_factory.mktemp("v3_fp8"), transformers.DeepseekV3Config(**V3_TINY))


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("v4_fp8_fp4")
    transformers.DeepseekV4Config(**V4_TINY).save_pretrained(path)
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(path))
    _randomise(model, 2)
    state = model.state_dict()
    tensors = official_names({n: t for n, t in state.items() if not n.startswith(("layers.", "mtp."))}, "")
    for prefix, block in [(f"layers.{i}.", b) for i, b in enumerate(model.layers)] + [("mtp.0.", model.mtp[0])]:
        tensors |= official_names(block.state_dict(), prefix)
    dense = re.compile(r"(layers|mtp)\.\d+\.(attn\..*|ffn\.shared_experts\..*|[eh]_proj)\.weight")
    save_file(_fp8(_fp4(tensors, V4_EXPERT, 3), dense, V4_BLOCK), path / "model.safetensors")
    return path


# --- loading --------------------------------------------------------------------------------------------
def _load(cls, path, block: tuple[int, int], keep: bool):
    """The model loaded dequantised, or with every quantised weight it can keep kept (the model API)."""
    cfg = ModelConfig.from_hf(path)
    model = cls(cfg)
    kept = model.keep_quantized_weights(quantized_weights(path, cfg.model_type), block) if keep else None
    model.load_weights(iter_checkpoint(path, cfg.model_type, block, keep_quantized=kept))
    model.kept_names = set() if kept is None else {n for n in quantized_weights(path, cfg.model_type) if kept(n)}
    return model.eval()


@pytest.fixture(scope="module")
def v3_pair(v3_ckpt):
    pair = [_load(DeepseekV3ForCausalLM, v3_ckpt, V3_BLOCK, keep) for keep in (True, False)]
    for model in pair:
        model.build_mtp()
    return pair


@pytest.fixture(scope="module")
def v4_pair(v4_ckpt):
    return [_load(DeepseekV4ForCausalLM, v4_ckpt, V4_BLOCK, keep) for keep in (True, False)]


TOKENS = [5, 77, 300, 12, 9, 401, 33, 250, 7, 100, 64, 3]


def _v3_outputs(model) -> list[torch.Tensor]:
    """Logits of a prefill chunk then one decode token, and MTP layer 0's hidden over the prefill."""
    run = PagedRun(model, include_mtp=True)
    meta = run._meta([(0, TOKENS[:8])])
    with torch.no_grad():
        hidden = model(meta)
        mtp = model.mtp_forward(0, hidden, torch.tensor(TOKENS[1:9]), meta)
        logits = model.compute_logits(hidden)
    return [logits, mtp, *run.step([(0, TOKENS[8:9])])]


def _v4_outputs(model) -> list[torch.Tensor]:
    """Main and MTP hidden rows of a prefill chunk and a decode step, and the logits of the main rows."""
    run = Run(model, [TOKENS])
    with torch.no_grad():
        rows = run.step([8]) + run.step([1])
        return rows + [model.compute_logits(rows[0])]


def _assert_all_close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def test_loader_keeps_the_chosen_weights_raw_with_their_scales(tmp_path):
    w = torch.randn(40, 64)
    q, s = quantize_fp8_block(w, (32, 32))
    codes, exps = torch.randint(0, 16, (8, 64)), torch.randint(-3, 3, (8, 2))
    save_file({"a.weight": q, "a.weight_scale_inv": s, "b.weight": q.clone(), "b.weight_scale_inv": s.clone(),
               "x.weight": pack_fp4(codes), "x.scale": e8m0(exps)}, tmp_path / "model.safetensors")
    info = quantized_weights(tmp_path, "deepseek_v3")
    assert {n: i.kind for n, i in info.items()} == {"a.weight": "fp8", "b.weight": "fp8", "x.weight": "mxfp4"}
    assert info["x.weight"].dtype == torch.int8 and info["x.weight"].scale_dtype == torch.float8_e8m0fnu
    keep = {"a.weight", "x.weight"}.__contains__
    names = [n for n, _, _ in iter_checkpoint(tmp_path, "deepseek_v3", (32, 32), keep_quantized=keep)]
    got = {n: t for n, t, _ in iter_checkpoint(tmp_path, "deepseek_v3", (32, 32), keep_quantized=keep)}
    for weight in ("a.weight", "x.weight"):  # a kept weight, then at once its scale
        assert names[names.index(weight) + 1] == weight.removesuffix("weight") + "weight_scale_inv"
    assert torch.equal(got["a.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["a.weight_scale_inv"], s)
    assert got["x.weight"].dtype == torch.int8 and got["x.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert got["b.weight"].dtype == torch.float32 and "b.weight_scale_inv" not in got  # not kept: dequantised
    default = {n: t for n, t, _ in iter_checkpoint(tmp_path, "deepseek_v3", (32, 32))}
    assert default.keys() == {"a.weight", "b.weight", "x.weight"} and torch.equal(default["a.weight"], got["b.weight"])


def test_v3_kept_quantised_logits_equal_dequantised(v3_pair):
    kept, plain = v3_pair
    _assert_all_close(_v3_outputs(kept), _v3_outputs(plain), atol=1e-5)


def test_v32_kept_quantised_logits_equal_dequantised(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _mla_ckpt(tmp_path, transformers.DeepseekV32Config(**V32_TINY))
    kept, plain = (_load(DeepseekV3ForCausalLM, path, V3_BLOCK, keep) for keep in (True, False))
    assert isinstance(kept.model.layers[2].self_attn.indexer.wk, FP8BlockLinear)
    assert kept.model.layers[2].mlp.experts.quant == "fp8"
    outputs = [PagedRun(m).step([(0, TOKENS)]) + PagedRun(m, seed=1).step([(0, TOKENS[:5])]) for m in (kept, plain)]
    _assert_all_close(*outputs, atol=1e-5)


def test_parallel_experts_keep_their_storage_dtypes():
    experts = ParallelExperts(4, 64, 32, 2, ModelParallel.single())
    experts.keep_quantized("fp8", (32, 32), torch.float8_e4m3fn, torch.bfloat16)  # bf16 scales are kept as float32
    experts.to(torch.bfloat16)
    assert (experts.w13.dtype, experts.w13_scale.dtype) == (torch.float8_e4m3fn, torch.float32)
    assert experts.w13.expert_quant.scale is experts.w13_scale and experts.w13_scale.shape == (4, 2, 2)
    with pytest.raises(ValueError, match="cannot be stacked"):  # gate and up scales would share a 128-row block
        ParallelExperts(4, 64, 32, 2, ModelParallel.single()).keep_quantized(
            "fp8", (128, 128), torch.float8_e4m3fn, torch.float32)


def test_v4_kept_quantised_logits_equal_dequantised(v4_pair):
    kept, plain = v4_pair
    assert kept.mtp_loaded and plain.mtp_loaded
    _assert_all_close(_v4_outputs(kept), _v4_outputs(plain), atol=1e-5)


def _kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantised storage: FP8BlockLinear weight + scale, quantised experts' codes + scales."""
    total = sum(m.memory_bytes() for m in model.modules() if isinstance(m, FP8BlockLinear))
    experts = [m for m in model.modules() if isinstance(m, ParallelExperts) and m.quant]
    return total + sum(t.nbytes for m in experts for t in (m.w13, m.w2, m.w13_scale, m.w2_scale))


def _checkpoint_bytes(path, names: set[str]) -> int:
    """Bytes the checkpoint stores for these weights and their scales (whatever the scale suffix)."""
    from safetensors.torch import load_file

    stored = load_file(path / "model.safetensors")
    stems = {n.removesuffix(".weight") for n in names}
    return sum(t.nbytes for n, t in stored.items() if n.rpartition(".")[0] in stems)


def _float_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def test_v3_modules_and_memory(v3_pair, v3_ckpt):
    kept, plain = v3_pair
    attn, mlp = kept.model.layers[1].self_attn, kept.model.layers[1].mlp
    assert isinstance(attn.q_a_proj, FP8BlockLinear) and isinstance(kept.mtp[0].eh_proj, FP8BlockLinear)
    assert type(attn.kv_b_proj) is torch.nn.Linear  # absorbed decode reads its weight: dequantised
    assert isinstance(kept.model.layers[0].mlp.gate_proj, FP8BlockLinear)
    for experts in (mlp.experts, kept.mtp[0].block.mlp.experts):
        assert experts.quant == "fp8" and experts.w13.dtype == torch.float8_e4m3fn
        assert experts.w13_scale.shape == (8, 128 // 32, 128 // 32) and experts.w2_scale.dtype == torch.float32
    assert any(n.startswith("model.layers.3.") for n in kept.kept_names)
    assert _kept_bytes(kept) == _checkpoint_bytes(v3_ckpt, kept.kept_names)
    assert _kept_bytes(plain) == 0 and _float_bytes(kept) < _float_bytes(plain)


def test_v4_modules_and_memory(v4_pair, v4_ckpt):
    kept, plain = v4_pair
    for block in (kept.layers[1], kept.mtp[0]):
        assert isinstance(block.attn.wq_a, FP8BlockLinear) and isinstance(block.ffn.shared_experts.w2, FP8BlockLinear)
        assert type(block.attn.wo_a) is torch.nn.Linear  # the grouped bmm reads its weight: dequantised
        experts = block.ffn.experts
        assert experts.quant == "mxfp4" and experts.w13.dtype == torch.int8 and experts.w13.shape == (8, 128, 64)
        assert experts.w2_scale.dtype == torch.float8_e8m0fnu and experts.w2_scale.shape == (8, 128, 2)
    assert isinstance(kept.layers[1].attn.compressor.wkv, FP8BlockLinear)
    assert _kept_bytes(kept) == _checkpoint_bytes(v4_ckpt, kept.kept_names)
    assert _float_bytes(kept) < _float_bytes(plain)


def test_bad_scale_shape_is_a_checkpoint_error_naming_the_tensor(v3_ckpt, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(v3_ckpt / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1]
    (tmp_path / "config.json").write_text((v3_ckpt / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    named = r"layers\.1\.mlp\.experts\.2\.up_proj\.weight with \S*experts\.2\.up_proj\.weight_scale_inv: scale shape"
    with pytest.raises(CheckpointError, match=named):
        _load(DeepseekV3ForCausalLM, tmp_path, V3_BLOCK, keep=True)


def test_sharded_models_refuse_kept_quantised_weights(v4_ckpt):
    config = ModelConfig.from_hf(v4_ckpt)
    rank = DeepseekV4ForCausalLM(config, parallel=ModelParallel(placement=place_experts(8, 2), ep_rank=0))
    with pytest.raises(ValueError, match="single process"):
        rank.keep_quantized_weights(quantized_weights(v4_ckpt, "deepseek_v4"))
    assert not any(isinstance(m, FP8BlockLinear) for m in rank.modules())


def test_load_model_keeps_quantised_on_request(v4_ckpt, monkeypatch):
    config = ModelConfig.from_hf(v4_ckpt)
    plain = load_model(v4_ckpt, config, torch.float32, torch.device("cpu"))  # CPU default: dequantised
    assert not any(isinstance(m, FP8BlockLinear) for m in plain.modules())
    monkeypatch.setenv(KEEP_QUANTIZED_ENV, "1")
    kept = load_model(v4_ckpt, config, torch.float32, torch.device("cpu"))
    assert isinstance(kept.layers[0].attn.wq_a, FP8BlockLinear) and kept.layers[0].ffn.experts.quant == "mxfp4"


def test_triton_paths_match_the_torch_path(v3_pair, v4_pair, monkeypatch):
    """FP8BlockLinear's W8A16 GEMM and fused_moe (FP8 and MXFP4) under the interpreter vs dequantise-in-torch."""
    pytest.importorskip("triton")
    expected = [_v3_outputs(v3_pair[0]), _v4_outputs(v4_pair[0])]
    for module in (quant_linear_module, moe_module):
        monkeypatch.setattr(module, "triton_enabled", lambda t: True)
    _assert_all_close(_v3_outputs(v3_pair[0]), expected[0], atol=1e-4)
    _assert_all_close(_v4_outputs(v4_pair[0]), expected[1], atol=1e-4)
