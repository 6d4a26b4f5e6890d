"""Checkpoint loader: discovery, sharding, V4 name canonicalisation, FP8/FP4 dequantisation, errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from quantize_utils import (
    E2M1_VALUES,
    block_amax,
    e8m0,
    expand_blocks,
    fp8_scale_inv,
    fp8_scale_ue8m0,
    pack_fp4,
    quantize_fp8,
)
from safetensors.torch import load_file, save_file
from tiny_models import V4_TINY

from deepinfer.models.loader import (
    CheckpointError,
    canonical_name,
    checkpoint_files,
    dequantize_fp4,
    iter_checkpoint,
    quantization_block_size,
)

# Same values as the shared reference's tiny DeepSeek-V4 config (transformers 5.24 DeepseekV4Config).
_L = r"(?:layers|mtp)\.\d+\."
_COMP = r"compressor\.(?:wkv\.weight|wgate\.weight|ape|norm\.weight)"
V4_CANONICAL = re.compile("|".join([
    r"embed\.weight", r"head\.weight", r"norm\.weight", r"hc_head_(?:fn|base|scale)",
    _L + r"(?:attn_norm|ffn_norm)\.weight", _L + r"hc_(?:attn|ffn)_(?:fn|base|scale)",
    _L + r"attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight", _L + r"attn\.attn_sink",
    _L + r"attn\." + _COMP, _L + r"attn\.indexer\.(?:wq_b|weights_proj)\.weight",
    _L + r"attn\.indexer\." + _COMP, _L + r"ffn\.gate\.(?:weight|bias|tid2eid)",
    _L + r"ffn\.experts\.\d+\.w[123]\.weight", _L + r"ffn\.shared_experts\.w[123]\.weight",
]))


def load_all(path, model_type="deepseek_v4", **kw) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor, _ in iter_checkpoint(path, model_type, **kw):
        assert name not in out, name
        out[name] = tensor
    return out


def save_shards(directory, shards: list[dict[str, torch.Tensor]]):
    """`shards` as model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / file)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def save_single(directory, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    return directory


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# --- V4 names -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**V4_TINY))
    path = tmp_path_factory.mktemp("v4_hf")
    model.save_pretrained(path)
    return path, model.state_dict()


def to_official(name: str) -> str:
    """transformers-saved name -> DeepSeek's official name (written independently of the loader's tables)."""
    name = name.removeprefix("model.")
    name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
    name = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
    # The official main-attention KV norm is spelled either way; use both to cover both.
    return re.sub(r"^layers\.([02])\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight", name)


def test_v4_saved_and_official_names_agree(v4_model, tmp_path):
    hf_dir, _ = v4_model
    saved = load_file(hf_dir / "model.safetensors")
    assert "model.layers.0.attn.norm.weight" in saved and "model.embed_tokens.weight" in saved
    official_dir = save_single(tmp_path / "official", {to_official(k): v for k, v in saved.items()})
    from_hf, from_official = load_all(hf_dir), load_all(official_dir)
    assert_same(from_hf, from_official)
    assert len(from_hf) == len(saved)
    assert [n for n in from_hf if not V4_CANONICAL.fullmatch(n)] == []
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight",
                 "layers.0.ffn.gate.tid2eid", "layers.1.attn.compressor.norm.weight",
                 "layers.1.attn.indexer.compressor.norm.weight", "layers.3.ffn.experts.7.w2.weight"):
        assert name in from_hf, name


def test_v4_in_memory_transformers_names(v4_model):
    hf_dir, state = v4_model
    from_hf = load_all(hf_dir)
    fused = re.compile(r".*(\.mlp\.experts\.(gate_up|down)_proj|rotary_emb\..*)")  # not renames: model's job
    checked = 0
    for name, tensor in state.items():
        if fused.fullmatch(name):
            continue
        canon = canonical_name(name, "deepseek_v4")
        assert canon in from_hf, (name, canon)
        assert torch.equal(from_hf[canon], tensor), name
        checked += 1
    assert checked == len(from_hf) - 4 * 8 * 3  # everything but the per-expert w1/w2/w3


@pytest.mark.parametrize("name, canon", [
    ("mtp.0.attn.norm.weight", "mtp.0.attn.kv_norm.weight"),
    ("mtp.0.attn.compressor.norm.weight", "mtp.0.attn.compressor.norm.weight"),
    ("mtp.0.norm.weight", "mtp.0.norm.weight"),
    ("mtp.0.enorm.weight", "mtp.0.enorm.weight"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn"),
    ("mtp.0.ffn.experts.3.w1.weight", "mtp.0.ffn.experts.3.w1.weight"),
    ("layers.5.attn.kv_norm.weight", "layers.5.attn.kv_norm.weight"),
    ("layers.5.attn.indexer.compressor.norm.weight", "layers.5.attn.indexer.compressor.norm.weight"),
    ("model.layers.5.attn.norm.weight", "layers.5.attn.kv_norm.weight"),
    ("model.layers.5.mlp.experts.2.up_proj.weight", "layers.5.ffn.experts.2.w3.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("something.unknown", "something.unknown"),
])
def test_v4_canonical_name(name, canon):
    assert canonical_name(name, "deepseek_v4") == canon


def test_v3_v2_names_unchanged():
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_a_proj.weight", "lm_head.weight"):
        assert canonical_name(name, "deepseek_v3") == name == canonical_name(name, "deepseek_v2")
    with pytest.raises(ValueError, match="llama"):
        canonical_name("x", "llama")


# --- sharding -------------------------------------------------------------------------------------------
def test_sharded_equals_single(v4_model, tmp_path):
    hf_dir, _ = v4_model
    saved = load_file(hf_dir / "model.safetensors")
    names = sorted(saved)
    shards = [{n: saved[n] for n in names[i::3]} for i in range(3)]
    sharded = save_shards(tmp_path / "sharded", shards)
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [f.name for f in checkpoint_files(sharded)] == shard_names
    assert_same(load_all(sharded), load_all(hf_dir))
    files = {canonical_name(n, "deepseek_v4"): shard_names[i % 3] for i, n in enumerate(names)}
    assert {n: f for n, _, f in iter_checkpoint(sharded, "deepseek_v4")} == files


def test_unindexed_safetensors_set(tmp_path):
    save_file({"b": torch.ones(2)}, tmp_path / "b.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "a.safetensors")
    assert [f.name for f in checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert [(n, f) for n, _, f in iter_checkpoint(tmp_path, "deepseek_v3")] == [
        ("a", "a.safetensors"), ("b", "b.safetensors")]


# --- FP8 ------------------------------------------------------------------------------------------------
# Error bound of block FP8. e4m3 keeps 3 mantissa bits: for 2^e <= |x| < 2^(e+1) (normal, e >= -6) the
# spacing is 2^(e-3), so round-to-nearest errs by <= 2^(e-4) <= 2^-4 |x|; below 2^-6 (subnormal) the
# spacing is 2^-9, error <= 2^-10. The quantiser stores x = w / s with s >= amax / 448 (|x| <= 448: no
# saturation) and the loader returns q * s, so per element |w' - w| = s |q - x| <= max(2^-4 |w|, 2^-10 s).
# Both terms are <= 2^-4 * amax of the block: |w| <= amax, and s <= 2 amax / 448 (a UE8M0 power of two at
# most doubles amax / 448), so 2^-10 s < 2^-4 amax. float32 rounding of w / s and q * s adds < 2^-20 amax.
def assert_fp8_close(w: torch.Tensor, got: torch.Tensor, scale: torch.Tensor, block):
    err = (got - w).abs()
    amax = expand_blocks(block_amax(w, block), w.shape, block)
    s = expand_blocks(scale.float(), w.shape, block)
    assert (err <= 2**-4 * w.abs() + 2**-10 * s + 2**-20 * amax).all()
    assert (err <= 2**-4 * amax + 2**-20 * amax).all()
    assert err.max() > 0  # the data really went through FP8


SHAPES = [(300, 200), (128, 256), (1, 130), (257, 129)]


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_weight_scale_inv(tmp_path, block):
    torch.manual_seed(1)
    originals, tensors = {}, {"model.norm.weight": torch.randn(8)}
    for i, shape in enumerate(SHAPES):
        w = torch.randn(shape) * 10 ** (i - 2)
        name = f"model.layers.{i}.self_attn.q_a_proj"
        scale = fp8_scale_inv(w, block)
        tensors |= {f"{name}.weight": quantize_fp8(w, scale, block), f"{name}.weight_scale_inv": scale}
        originals[f"{name}.weight"] = (w, scale)
    got = load_all(save_single(tmp_path, tensors), "deepseek_v3", block_size=block)
    assert got.keys() == originals.keys() | {"model.norm.weight"}
    for name, (w, scale) in originals.items():
        assert got[name].dtype == torch.float32 and got[name].shape == w.shape
        assert_fp8_close(w, got[name], scale, block)


def test_fp8_ue8m0_scale_v4(tmp_path):
    torch.manual_seed(2)
    originals, tensors = {}, {}
    for i, shape in enumerate(SHAPES):
        w = torch.randn(shape) * 10 ** (i - 2)
        scale = fp8_scale_ue8m0(w, (128, 128))
        assert scale.dtype == torch.float8_e8m0fnu
        tensors |= {f"layers.{i}.attn.wq_a.weight": quantize_fp8(w, scale, (128, 128)),
                    f"layers.{i}.attn.wq_a.scale": scale}
        originals[f"layers.{i}.attn.wq_a.weight"] = (w, scale)
    got = load_all(save_single(tmp_path, tensors))
    assert got.keys() == originals.keys()
    for name, (w, scale) in originals.items():
        assert_fp8_close(w, got[name], scale, (128, 128))


def test_quantization_block_size():
    assert quantization_block_size({}) == (128, 128)
    assert quantization_block_size({"quantization_config": {"weight_block_size": [64, 32]}}) == (64, 32)
    with pytest.raises(CheckpointError, match="weight_block_size"):
        quantization_block_size({"quantization_config": {"weight_block_size": [128]}})


# --- FP4 ------------------------------------------------------------------------------------------------
def test_fp4_round_trip_exact(tmp_path):
    g = torch.Generator().manual_seed(3)
    out, inp = 48, 96
    codes = torch.randint(0, 16, (out, inp), generator=g)
    exponents = torch.randint(-10, 6, (out, inp // 32), generator=g)
    # Exactly representable: an E2M1 value times a power of two is exact in float32.
    expected = E2M1_VALUES[codes] * torch.exp2(exponents.float()).repeat_interleave(32, 1)
    name = "layers.0.ffn.experts.5.w2"
    tensors = {f"{name}.weight": pack_fp4(codes), f"{name}.scale": e8m0(exponents)}
    packed = tensors[f"{name}.weight"]
    assert packed.dtype == torch.int8 and packed.shape == (out, inp // 2)
    got = load_all(save_single(tmp_path, tensors))
    assert list(got) == [f"{name}.weight"]
    assert got[f"{name}.weight"].dtype == torch.float32 and torch.equal(got[f"{name}.weight"], expected)


def test_fp4_nibble_order():
    # DeepSeek-V4 inference/convert.py unpacks byte b of a row as inputs (2i, 2i+1) = (b & 0x0F, b >> 4).
    row = torch.zeros(1, 16, dtype=torch.uint8)
    row[0, 0], row[0, 1] = 0x21, 0x7F  # low 1 -> 0.5, high 2 -> 1.0; low 0xF -> -6.0, high 7 -> 6.0
    got = dequantize_fp4(row.view(torch.int8), e8m0(torch.tensor([[1]])))  # scale 2^1
    assert got[0, :4].tolist() == [1.0, 2.0, -12.0, 12.0]
    assert (got[0, 4:] == 0).all()
    assert E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_pairs_across_shards(tmp_path):
    torch.manual_seed(4)
    w = torch.randn(130, 70)
    scale = fp8_scale_ue8m0(w, (128, 128))
    codes = torch.randint(0, 16, (4, 64))
    exps = torch.zeros(4, 2, dtype=torch.int32)
    pieces = {"layers.0.attn.wo_b.weight": quantize_fp8(w, scale, (128, 128)),
              "layers.0.attn.wo_b.scale": scale,
              "layers.0.ffn.experts.0.w1.weight": pack_fp4(codes),
              "layers.0.ffn.experts.0.w1.scale": e8m0(exps)}
    single = load_all(save_single(tmp_path / "single", pieces))
    names = sorted(pieces)  # scales sort before their weights: put each half in a different shard
    split = [{names[0]: pieces[names[0]]}, {"norm.weight": torch.ones(3), names[3]: pieces[names[3]]},
             {names[1]: pieces[names[1]], names[2]: pieces[names[2]]}]
    got = load_all(save_shards(tmp_path / "sharded", split))
    assert_same(got, single | {"norm.weight": torch.ones(3)})
    assert torch.equal(got["layers.0.ffn.experts.0.w1.weight"], E2M1_VALUES[codes])
    files = {n: f for n, _, f in iter_checkpoint(tmp_path / "sharded", "deepseek_v4")}  # the weight's shard
    assert files["layers.0.attn.wo_b.weight"] == "model-00003-of-00003.safetensors"
    assert files["layers.0.ffn.experts.0.w1.weight"] == "model-00002-of-00003.safetensors"


# --- errors ---------------------------------------------------------------------------------------------
def test_missing_shard_named(tmp_path):
    save_shards(tmp_path, [{"a": torch.ones(1)}, {"b": torch.ones(1)}, {"c": torch.ones(1)}])
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*\bb\b"):
        checkpoint_files(tmp_path)
    with pytest.raises(CheckpointError, match="model-00002-of-00003"):
        iter_checkpoint(tmp_path, "deepseek_v3")


def test_bad_index_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        checkpoint_files(tmp_path)


def test_index_tensor_not_in_shard(tmp_path):
    save_shards(tmp_path, [{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: tensor b"):
        iter_checkpoint(tmp_path, "deepseek_v3")


def test_truncated_file_named(tmp_path):
    save_single(tmp_path, {"a": torch.randn(64, 64), "b": torch.randn(64)})
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        list(iter_checkpoint(tmp_path, "deepseek_v3"))


def test_quantised_weight_without_scale_named(tmp_path):
    save_single(tmp_path, {"layers.0.attn.wq_a.weight": torch.randn(4, 4).to(torch.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.0\.attn\.wq_a\.weight.*"
                                              r"layers\.0\.attn\.wq_a\.weight_scale_inv"):
        iter_checkpoint(tmp_path, "deepseek_v4")


def test_scale_without_weight_named(tmp_path):
    save_single(tmp_path, {"layers.0.attn.wq_a.scale": e8m0(torch.zeros(1, 1, dtype=torch.int32)),
                           "layers.1.attn.wq_a.weight": torch.randn(2, 2)})
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale.*layers\.0\.attn\.wq_a\.weight"):
        iter_checkpoint(tmp_path, "deepseek_v4")
    save_single(tmp_path, {"x.weight_scale_inv": torch.ones(1, 1), "x.weight": torch.randn(2, 2)})
    with pytest.raises(CheckpointError, match=r"x\.weight_scale_inv.*x\.weight is F32, not quantised"):
        iter_checkpoint(tmp_path, "deepseek_v3")


def test_float_scale_tensor_is_not_a_quant_scale(tmp_path):
    # transformers' in-memory hyper-connection parameter ends in ".scale" but is a plain float tensor.
    save_single(tmp_path, {"model.layers.0.attn_hc.scale": torch.ones(3)})
    assert list(load_all(tmp_path)) == ["layers.0.hc_attn_scale"]


def test_scale_shape_mismatch_named(tmp_path):
    w = torch.randn(256, 128)
    save_single(tmp_path, {"w.weight": quantize_fp8(w, torch.ones(2, 1), (128, 128)),
                           "w.weight_scale_inv": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"w\.weight with w\.weight_scale_inv.*expected \(2, 1\)"):
        list(iter_checkpoint(tmp_path, "deepseek_v3"))


def test_duplicate_canonical_names(tmp_path):
    save_single(tmp_path, {"layers.0.attn.norm.weight": torch.ones(2),
                           "layers.0.attn.kv_norm.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match="layers.0.attn.kv_norm.weight"):
        iter_checkpoint(tmp_path, "deepseek_v4")


def test_directory_without_weights_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))):
        checkpoint_files(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint_files(tmp_path / "absent")


def test_progress_bar(tmp_path, capsys):
    save_shards(tmp_path, [{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    assert [n for n, _, _ in iter_checkpoint(tmp_path, "deepseek_v3", progress=True)] == ["a", "b"]
    assert "2 shard" in capsys.readouterr().err
