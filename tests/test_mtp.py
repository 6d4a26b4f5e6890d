"""DeepSeek-V4 MTP: config kinds, loading official `mtp.0.*` tensors (all, none, one missing), causal and
chunk-consistent forward over a ragged batch with caches, and gradients for training.

Checkpoints are tiny V4 models saved by transformers (which drops MTP), plus a second shard of random
MTP tensors under DeepSeek's official names.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny_models import make_reference, save_reference
from v4_runs import BLOCK, Run, load_v4, official_names, random_mtp_tensors, randomise, write_shards

from deepinfer.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.loader import CheckpointError


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=3), tmp_path_factory.mktemp("v4_plain"))


@pytest.fixture(scope="module")
def mtp_tensors(plain_ckpt):
    return random_mtp_tensors(ModelConfig.from_hf(plain_ckpt))


def _with_mtp(plain, tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "ckpt"
    shutil.copytree(plain, path)
    write_shards(path, tensors)
    return path


@pytest.fixture(scope="module")
def mtp_model(plain_ckpt, mtp_tensors, tmp_path_factory):
    return load_v4(_with_mtp(plain_ckpt, tmp_path_factory.mktemp("v4_mtp"), mtp_tensors))


# --- config --------------------------------------------------------------------------------------
def _raw_config(plain_ckpt) -> dict:
    return json.loads((plain_ckpt / "config.json").read_text())


@pytest.mark.parametrize("mtp_ratio, kind", [(0, SLIDING), (4, CSA), (16, HCA)])
def test_official_compress_ratios_give_the_mtp_kind(plain_ckpt, mtp_ratio, kind):
    raw = _raw_config(plain_ckpt)
    raw.pop("layer_types")
    raw["compress_ratios"] = [0, 4, 16, 4, mtp_ratio]  # DeepSeek's layout: one entry per layer, then MTP
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_kinds == (SLIDING, CSA, HCA, CSA) and cfg.compress_ratios == (0, 4, 16, 4)
    assert cfg.mtp_layer_kinds == (kind,) and cfg.mtp_compress_ratios == (mtp_ratio,)


def test_transformers_config_defaults_the_mtp_kind_to_the_last_layer(plain_ckpt):
    """transformers truncates layer_types to the main layers; MTP then takes the last layer's kind."""
    cfg = ModelConfig.from_hf(plain_ckpt)
    assert len(_raw_config(plain_ckpt)["layer_types"]) == cfg.num_layers
    assert cfg.mtp_layer_kinds == cfg.layer_kinds[-1:] and cfg.mtp_compress_ratios == cfg.compress_ratios[-1:]
    two = ModelConfig.from_dict({**_raw_config(plain_ckpt), "num_nextn_predict_layers": 2})
    assert two.mtp_layer_kinds == cfg.layer_kinds[-1:] * 2


def test_mtp_layer_is_built_with_its_kind_and_learned_routing(plain_ckpt):
    cfg = replace(ModelConfig.from_hf(plain_ckpt), mtp_layer_kinds=(SLIDING,), mtp_compress_ratios=(0,))
    layer = DeepseekV4ForCausalLM(cfg).mtp[0]
    assert layer.attn.kind == SLIDING and not hasattr(layer.attn, "compressor")
    assert not layer.ffn.gate.is_hash and cfg.hash_layers[0]


# --- loading -------------------------------------------------------------------------------------
def test_checkpoint_with_official_mtp_tensors_loads_them(mtp_model, mtp_tensors):
    assert mtp_model.mtp_loaded
    state = official_names(mtp_model.mtp[0].state_dict(), "mtp.0.")
    assert state.keys() == mtp_tensors.keys()
    assert all(torch.equal(state[n], mtp_tensors[n]) for n in state)
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight"} <= state.keys()


def test_checkpoint_without_mtp_tensors_loads_without_mtp(plain_ckpt):
    model = load_v4(plain_ckpt)
    assert len(model.mtp) == 1 and not model.mtp_loaded
    assert not any(n.startswith("mtp.") for n in load_file(plain_ckpt / "model.safetensors"))


@pytest.mark.parametrize("dropped", ["mtp.0.e_proj.weight", "mtp.0.attn.attn_sink"])
def test_a_missing_mtp_tensor_is_named(plain_ckpt, mtp_tensors, tmp_path, dropped):
    path = _with_mtp(plain_ckpt, tmp_path, {n: t for n, t in mtp_tensors.items() if n != dropped})
    with pytest.raises(CheckpointError, match=dropped):
        load_v4(path)


# --- forward -------------------------------------------------------------------------------------
def _by_sequence(rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(rows.split(counts))


def _chunked(model, seqs, splits: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per depth, per sequence: the hidden rows of all positions, computed over several steps."""
    run, parts = Run(model, seqs), []
    for counts in splits:
        parts.append([_by_sequence(h, counts) for h in run.step(counts)])
    depths = len(parts[0])
    return [[torch.cat([p[d][r] for p in parts]) for r in range(len(seqs))] for d in range(depths)]


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (45, 38)]


def _variant(model: DeepseekV4ForCausalLM, kind: str) -> DeepseekV4ForCausalLM:
    """The loaded model with MTP layers of another kind (random weights), or two MTP layers."""
    cfg = model.config
    if kind == "two_layers":
        cfg = replace(cfg, num_mtp_layers=2, mtp_layer_kinds=(CSA, HCA), mtp_compress_ratios=(4, 16))
    else:
        cfg = replace(cfg, mtp_layer_kinds=(kind,), mtp_compress_ratios=({SLIDING: 0, CSA: 4, HCA: 16}[kind],))
    other = DeepseekV4ForCausalLM(cfg)
    other.load_state_dict({n: t for n, t in model.state_dict().items() if not n.startswith("mtp.")}, strict=False)
    randomise(other.mtp, seed=8)
    return other


@pytest.mark.parametrize("kind", ["loaded", SLIDING, HCA, "two_layers"])
def test_mtp_hidden_is_the_same_in_one_pass_and_in_chunks(mtp_model, seqs, kind):
    model = mtp_model if kind == "loaded" else _variant(mtp_model, kind)
    with torch.no_grad():
        full = _chunked(model, seqs, [[len(s) for s in seqs]])
        chunked = _chunked(model, seqs, [[13, 21], [1, 6], [31, 11]])
    assert len(full) == 1 + len(model.mtp)
    for depth_full, depth_chunked in zip(full, chunked):
        for a, b in zip(depth_full, depth_chunked):
            assert a.shape == b.shape and torch.isfinite(a).all()
            assert (a - b).abs().max().item() < 1e-5


def test_mtp_hidden_is_causal(mtp_model, seqs):
    """Row t sees tokens 0..t + 1 only: changing tokens from position p on leaves rows < p - 1 unchanged."""
    p = 20
    changed = [seqs[0][:p] + [(t + 1) % 509 + 3 for t in seqs[0][p:]], seqs[1]]
    with torch.no_grad():
        before = _chunked(mtp_model, seqs, [[len(s) for s in seqs]])[1]
        after = _chunked(mtp_model, changed, [[len(s) for s in changed]])[1]
    diff = [(before[0][:p - 1] - after[0][:p - 1]).abs().max(), (before[1] - after[1]).abs().max()]
    assert max(diff).item() < 1e-5  # the batch's other rows may round differently
    assert (before[0][p - 1] - after[0][p - 1]).abs().max().item() > 1e-2


def test_mtp_cache_is_allocated_on_request(mtp_model, seqs):
    assert not any(s.name.startswith("mtp.") for s in mtp_model.kv_cache_spec(BLOCK))
    names = {s.name for s in mtp_model.kv_cache_spec(BLOCK, include_mtp=True)}
    assert {"mtp.0.window", "layers.0.window"} <= names
    model = _variant(mtp_model, SLIDING)
    meta = Run(model, seqs).meta([3, 2])
    model.bind_kv_cache({s.name: torch.zeros((32, *s.shape), dtype=s.dtype) for s in model.kv_cache_spec(BLOCK)})
    _, streams = model(meta, return_mtp_input=True)
    with pytest.raises(RuntimeError, match="include_mtp=True"):
        model.mtp_forward(0, streams, meta.input_ids, meta)
    with pytest.raises(ValueError, match="streams"):
        model.mtp_forward(0, streams[:, 0], meta.input_ids, meta)


def test_training_step_sends_gradients_through_mtp(mtp_model, seqs):
    """Main logits at t predict t + 1; MTP at t (embedding of t + 1) predicts t + 2; the last rows are masked."""
    model = _variant(mtp_model, CSA)
    run = Run(model, seqs)
    meta = run.meta([len(s) for s in seqs])
    hidden, streams = model(meta, return_mtp_input=True)
    mtp_hidden = model.mtp_forward(0, streams, run.next_ids(meta, 0), meta)
    target1, target2 = run.next_ids(meta, 0), run.next_ids(meta, 1)
    keep1 = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in seqs])
    keep2 = torch.cat([torch.arange(len(s)) < len(s) - 2 for s in seqs])
    loss = F.cross_entropy(model.compute_logits(hidden[keep1]), target1[keep1]) + \
        F.cross_entropy(model.compute_logits(mtp_hidden[keep2]), target2[keep2])
    loss.backward()
    grads = dict(model.named_parameters())
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.attn.wq_a.weight", "mtp.0.attn.wkv.weight",
                 "mtp.0.ffn.experts.w13", "mtp.0.ffn.shared_experts.w1.weight", "mtp.0.hc_attn.fn",
                 "mtp.0.hc_head.fn", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight",
                 "layers.0.attn.wq_a.weight", "embed.weight", "head.weight"):
        grad = grads[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
