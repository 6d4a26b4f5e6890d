"""Sharded loading: an expert-parallel rank reads, dequantises and copies only the experts it holds.

A "rank" here is the single-process V4 model with every routed-expert module replaced by the rank's
``ParallelExperts`` (``ModelParallel(placement=place_experts(E, world), ep_rank=r)``: no process group is
needed to build or load it, only to run it). The checkpoint handles are wrapped to record every tensor whose
data is read, so "never read" is observed, not inferred.
"""

from __future__ import annotations

import re

import pytest
import torch
from quantize_utils import e8m0, fp8_scale_ue8m0, pack_fp4, quantize_fp8
from safetensors.torch import save_file
from tiny_models import make_reference, save_reference
from torch import nn
from tqdm import tqdm

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.distributed.moe_comm import place_experts
from deepinfer.distributed.tp import TPRank, column_shard, head_shard, row_shard, vocab_shard
from deepinfer.models import loader
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.loader import CheckpointError, iter_checkpoint
from deepinfer.models.weights import contiguous_block, wanted_names

EXPERT = re.compile(r"^(?P<layer>.*)\.experts\.(?P<idx>\d+)\.")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# --- checkpoints ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    """transformers-saved tiny V4 (float32, per-expert tensors, one file)."""
    pytest.importorskip("transformers")
    return save_reference(make_reference("v4", seed=5), tmp_path_factory.mktemp("v4_plain"))


@pytest.fixture(scope="module")
def quant_ckpt(plain_ckpt, tmp_path_factory):
    """The official layout: FP4 routed experts (UE8M0 `.scale` per 32 inputs), FP8 attention projections
    (UE8M0 128x128 blocks), over two shards with an index; the rest float32."""
    path = tmp_path_factory.mktemp("v4_quant")
    (path / "config.json").write_text((plain_ckpt / "config.json").read_text())
    g = torch.Generator().manual_seed(7)
    shards: tuple[dict, dict] = ({}, {})
    for name, tensor, _ in iter_checkpoint(plain_ckpt, "deepseek_v4"):
        stem, shard = name.removesuffix(".weight"), shards[name.startswith(("layers.2.", "layers.3."))]
        if EXPERT.match(name):
            codes = torch.randint(0, 16, tensor.shape, generator=g)
            exps = torch.randint(-8, -2, (tensor.shape[0], tensor.shape[1] // 32), generator=g)
            shard |= {name: pack_fp4(codes), f"{stem}.scale": e8m0(exps)}
        elif re.fullmatch(r"layers\.\d+\.attn\.w(q_a|q_b|kv|o_b)\.weight", name):
            scale = fp8_scale_ue8m0(tensor, (128, 128))
            shard |= {name: quantize_fp8(tensor, scale, (128, 128)), f"{stem}.scale": scale}
        else:
            shard[name] = tensor
    _save_indexed(path, shards)
    return path


def _save_indexed(path, shards) -> None:
    import json

    weight_map = {}
    for file, tensors in zip(SHARDS, shards):
        save_file(tensors, path / file)
        weight_map |= dict.fromkeys(tensors, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- recording what is read ---------------------------------------------------------------------------
class _Recording:
    """A safe_open handle that logs (name, bytes) of every tensor whose data it hands out."""

    def __init__(self, handle, log: list[tuple[str, int]]):
        self.handle, self.log = handle, log

    def __enter__(self):
        self.f = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        tensor = self.f.get_tensor(name)
        self.log.append((name, tensor.nbytes))
        return tensor

    def get_slice(self, name):
        return _RecordingSlice(self.f.get_slice(name), name, self.log)


class _RecordingSlice:
    def __init__(self, piece, name, log):
        self.piece, self.name, self.log = piece, name, log

    def __getattr__(self, attr):  # get_dtype / get_shape: header only
        return getattr(self.piece, attr)

    def __getitem__(self, index):
        tensor = self.piece[index]
        self.log.append((self.name, tensor.nbytes))
        return tensor


@pytest.fixture
def reads(monkeypatch):
    """Every (raw name, bytes) read from a checkpoint file, and every weight name dequantised."""
    log: list[tuple[str, int]] = []
    dequantised: list[str] = []
    open_ = loader._open
    monkeypatch.setattr(loader, "_open", lambda file: _Recording(open_(file), log))
    dequantize = loader._dequantize

    def recording_dequantize(weight_name, *args):
        dequantised.append(weight_name)
        return dequantize(weight_name, *args)

    monkeypatch.setattr(loader, "_dequantize", recording_dequantize)
    return log, dequantised


# --- ranks ----------------------------------------------------------------------------------------------
def rank_model(path, world: int, rank: int) -> DeepseekV4ForCausalLM:
    """The tiny V4 model as EP rank `rank` of `world` builds it: routed experts hold only the rank's block."""
    config = ModelConfig.from_hf(path)
    mp = ModelParallel(placement=place_experts(config.n_routed_experts, world), ep_rank=rank)
    return DeepseekV4ForCausalLM(config, parallel=mp)  # no process group is needed to build and load it


def load(path, model) -> list[tuple[str, torch.Tensor, str]]:
    """Load `model` the way engine.core.load_model does; returns what the loader yielded."""
    yielded = list(iter_checkpoint(path, "deepseek_v4", wanted=wanted_names(model)))
    model.load_weights(iter(yielded))
    return yielded


def single_model(path) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(path))
    load(path, model)
    return model


def expert_bytes(items) -> int:
    return sum(nbytes for name, nbytes in items if EXPERT.match(name))


def local_of(world: int, rank: int, num_experts: int = 8) -> range:
    return place_experts(num_experts, world).local_experts(rank)


# --- tests ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "quant"])
@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (3, 2)])
def test_rank_reads_only_its_experts(kind, world, rank, request, reads):
    path = request.getfixturevalue(f"{kind}_ckpt")
    log, dequantised = reads
    log.clear(), dequantised.clear()  # building the checkpoint fixture read it
    load(path, rank_model(path, world, rank))
    local = local_of(world, rank)
    read_experts = {int(m["idx"]) for name, _ in log if (m := EXPERT.match(name))}
    assert read_experts == set(local)
    assert len({name for name, _ in log}) == len(log), "a tensor was read twice"
    if kind == "quant":  # scales come only with their weights, and only the rank's experts are dequantised
        scales = [name for name, _ in log if name.endswith(".scale")]
        assert all(int(EXPERT.match(s)["idx"]) in local for s in scales if EXPERT.match(s))
        assert {int(EXPERT.match(w)["idx"]) for w in dequantised if EXPERT.match(w)} == set(local)
        assert any(".attn." in w for w in dequantised)  # the dense FP8 weights every rank holds


@pytest.mark.parametrize("kind", ["plain", "quant"])
def test_rank_values_match_single_process(kind, request):
    path = request.getfixturevalue(f"{kind}_ckpt")
    full = dict(single_model(path).named_parameters())
    for rank in range(3):
        local = local_of(3, rank)
        model = rank_model(path, 3, rank)
        load(path, model)
        for name, param in model.named_parameters():
            if name.startswith("mtp."):  # not in the checkpoint (transformers drops MTP): left as built
                continue
            expected = full[name][local.start:local.stop] if name.endswith((".w13", ".w2")) else full[name]
            assert torch.equal(param, expected), (rank, name)


def test_expert_bytes_fall_with_world(quant_ckpt, reads):
    """Per rank, the expert bytes read from disk and the expert bytes the loader materialises are the
    rank's share len(local) / E of the single-process load's; the dense bytes stay the same."""
    log, _ = reads
    yielded_single = load(quant_ckpt, DeepseekV4ForCausalLM(ModelConfig.from_hf(quant_ckpt)))
    read_single, dense_single = expert_bytes(log), sum(b for _, b in log) - expert_bytes(log)
    for world in (2, 4):
        for rank in range(world):
            log.clear()
            yielded = load(quant_ckpt, rank_model(quant_ckpt, world, rank))
            share = len(local_of(world, rank)) / 8
            assert expert_bytes(log) == read_single * share
            assert sum(b for _, b in log) - expert_bytes(log) == dense_single
            materialised = expert_bytes((n, t.nbytes) for n, t, _ in yielded)
            assert materialised == expert_bytes((n, t.nbytes) for n, t, _ in yielded_single) * share


def test_rank_without_experts_loads(plain_ckpt, reads):
    """With more ranks than experts the last ranks hold none (empty w13 / w2): nothing expert is read."""
    log, _ = reads
    model = rank_model(plain_ckpt, 16, 12)
    load(plain_ckpt, model)
    assert model.get_submodule("layers.1.ffn.experts").w13.shape[0] == 0
    assert expert_bytes(log) == 0


def test_single_process_unchanged(quant_ckpt, reads):
    log, _ = reads
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(quant_ckpt))
    wanted = wanted_names(model)
    plain = [(n, f) for n, _, f in iter_checkpoint(quant_ckpt, "deepseek_v4")]
    read_plain = list(log)
    log.clear()
    filtered = [(n, f) for n, _, f in iter_checkpoint(quant_ckpt, "deepseek_v4", wanted=wanted)]
    assert filtered == plain and log == read_plain
    assert all(wanted(n) for n, _ in plain)


def test_unknown_names_still_raise(plain_ckpt, tmp_path):
    """The predicate wants unknown names, so the model's loading still rejects them, experts included."""
    tensors = {n: t for n, t, _ in iter_checkpoint(plain_ckpt, "deepseek_v4")}
    for extra in ("layers.1.ffn.experts.8.w1.weight", "layers.1.ffn.bogus.weight"):
        (tmp_path / extra).mkdir()
        (tmp_path / extra / "config.json").write_text((plain_ckpt / "config.json").read_text())
        save_file(tensors | {extra: torch.zeros(64, 128)}, tmp_path / extra / "model.safetensors")
        path = tmp_path / extra
        for model in (DeepseekV4ForCausalLM(ModelConfig.from_hf(path)), rank_model(path, 1, 0), rank_model(path, 2, 1)):
            with pytest.raises(CheckpointError, match=re.escape(f"unknown tensor {extra!r}")):
                load(path, model)


def test_unwanted_shard_is_not_opened_and_progress_counts_bytes_read(quant_ckpt, reads, capsys):
    log, _ = reads
    first = [n for n, _, f in iter_checkpoint(quant_ckpt, "deepseek_v4") if f == SHARDS[0]]
    log.clear()
    got = list(iter_checkpoint(quant_ckpt, "deepseek_v4", progress=True, wanted=set(first).__contains__))
    assert [n for n, _, _ in got] == first
    err = capsys.readouterr().err
    assert "Loading 1 shard(s)" in err and SHARDS[1] not in err
    read = tqdm.format_sizeof(sum(b for _, b in log))  # the bar's total is the bytes read, and it completes
    assert "100%" in err and f"{read}/{read}" in err, err


def test_header_errors_for_unwanted_tensors(tmp_path):
    """The header pass covers every tensor: an unwanted quantised weight without its scale still fails."""
    save_file({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "b": torch.ones(1)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="a.weight"):
        iter_checkpoint(tmp_path, "deepseek_v3", wanted=lambda name: name == "b")


def test_hf_expert_names_and_duck_typed_owner():
    """V3-style names (`model.layers.N.mlp.experts.E.gate_proj.weight`) and any module with local_index."""

    class Owner(nn.Module):
        num_experts = 4

        def local_index(self, expert):
            return expert - 2 if expert >= 2 else None

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mlp = nn.Module()
    root.model.layers[0].mlp.experts = Owner()
    wanted = wanted_names(root)
    prefix = "model.layers.0.mlp.experts"
    assert [wanted(f"{prefix}.{e}.gate_proj.weight") for e in range(4)] == [False, False, True, True]
    assert not wanted(f"{prefix}.1.down_proj.weight") and wanted(f"{prefix}.3.up_proj.weight")
    assert wanted(f"{prefix}.9.up_proj.weight")  # out of range: left for loading to reject
    assert wanted(f"{prefix}.gate_up_proj") and wanted("model.layers.0.mlp.shared_experts.gate_proj.weight")
    assert wanted("model.layers.1.mlp.experts.0.gate_proj.weight")  # no owner module there


# --- TP blocks ------------------------------------------------------------------------------------------
def test_contiguous_block_finds_tp_splits():
    tp = TPRank(1, 4)
    full = (8, 12)
    assert contiguous_block(lambda t: column_shard(t, tp, "w"), full) == (slice(2, 4), slice(None))
    assert contiguous_block(lambda t: row_shard(t, tp, "w"), full) == (slice(None), slice(3, 6))
    assert contiguous_block(lambda t: head_shard(t, 4, tp, "o", dim=1), full) == (slice(None), slice(3, 6))
    assert contiguous_block(lambda t: vocab_shard(t, TPRank(3, 4)), (37, 5)) == (slice(30, 37), slice(None))
    assert contiguous_block(lambda t: t[::2].clone(), full) is None  # not one block: read whole, then cut
    assert contiguous_block(lambda t: t, full) is None  # keeps everything


def test_tp_blocks_are_read_alone(plain_ckpt, reads):
    """A plain tensor whose parameter stores one contiguous block is read as that block only (get_slice); it
    carries its full shape, and equals what cutting the full tensor gives."""
    log, _ = reads
    tp = TPRank(1, 2)
    shards = {"layers.0.attn.wq_b.weight": lambda t: column_shard(t, tp, "wq_b"),
              "layers.1.attn.wo_b.weight": lambda t: row_shard(t, tp, "wo_b"),
              "embed.weight": lambda t: vocab_shard(t, tp)}
    full = {n: t for n, t, _ in iter_checkpoint(plain_ckpt, "deepseek_v4")}
    log.clear()
    ranges = lambda n, shape: contiguous_block(shards[n], shape) if n in shards else None  # noqa: E731
    got = {n: t for n, t, _ in iter_checkpoint(plain_ckpt, "deepseek_v4", ranges=ranges)}
    for name, shard in shards.items():
        assert torch.equal(got[name], shard(full[name])) and got[name].checkpoint_shape == tuple(full[name].shape)
        read = [b for raw, b in log if loader.canonical_name(raw, "deepseek_v4") == name]
        assert read == [full[name].nbytes // 2]
    assert not any(hasattr(t, "checkpoint_shape") for n, t in got.items() if n not in shards)
