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
from safetensors.torch import load_file, save_file
from tiny_models import make_reference, save_reference

from deepinfer.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.layers.metadata import ForwardMeta
from deepinfer.models.deepseek_v4 import _HC_RENAMES, DeepseekV4ForCausalLM
from deepinfer.models.loader import CheckpointError, iter_checkpoint

BLOCK = 16
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
_OFFICIAL_HC = {internal: official for official, internal in _HC_RENAMES.items()}


# --- checkpoints ---------------------------------------------------------------------------------
def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))


def _official_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Module state -> DeepSeek's checkpoint names: flat mHC names and one tensor per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("ffn.experts.w13"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif name.endswith("ffn.experts.w2"):
            out.update({f"{prefix}ffn.experts.{e}.w2.weight": t[e] for e in range(t.shape[0])})
        else:
            out[prefix + _OFFICIAL_HC.get(name, name)] = t
    return {k: v.clone().contiguous() for k, v in out.items()}


def _mtp_tensors(config: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    donor = DeepseekV4ForCausalLM(config)
    _randomise(donor.mtp, seed)
    return _official_names(donor.mtp[0].state_dict(), "mtp.0.")


def _write_shards(path, extra: dict[str, torch.Tensor]) -> None:
    """model.safetensors -> shard 1, `extra` -> shard 2, with an index listing both."""
    (path / "model.safetensors").rename(path / SHARDS[0])
    save_file(extra, path / SHARDS[1])
    names = {n: SHARDS[0] for n in load_file(path / SHARDS[0])} | {n: SHARDS[1] for n in extra}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


def _load(path, config: ModelConfig | None = None) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(config or ModelConfig.from_hf(path))
    model.load_weights(iter_checkpoint(path, "deepseek_v4"))
    return model


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=3), tmp_path_factory.mktemp("v4_plain"))


@pytest.fixture(scope="module")
def mtp_tensors(plain_ckpt):
    return _mtp_tensors(ModelConfig.from_hf(plain_ckpt))


def _with_mtp(plain, tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "ckpt"
    shutil.copytree(plain, path)
    _write_shards(path, tensors)
    return path


@pytest.fixture(scope="module")
def mtp_model(plain_ckpt, mtp_tensors, tmp_path_factory):
    return _load(_with_mtp(plain_ckpt, tmp_path_factory.mktemp("v4_mtp"), mtp_tensors))


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
    state = _official_names(mtp_model.mtp[0].state_dict(), "mtp.0.")
    assert state.keys() == mtp_tensors.keys()
    assert all(torch.equal(state[n], mtp_tensors[n]) for n in state)
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight"} <= state.keys()


def test_checkpoint_without_mtp_tensors_loads_without_mtp(plain_ckpt):
    model = _load(plain_ckpt)
    assert len(model.mtp) == 1 and not model.mtp_loaded
    assert not any(n.startswith("mtp.") for n in load_file(plain_ckpt / "model.safetensors"))


@pytest.mark.parametrize("dropped", ["mtp.0.e_proj.weight", "mtp.0.attn.attn_sink"])
def test_a_missing_mtp_tensor_is_named(plain_ckpt, mtp_tensors, tmp_path, dropped):
    path = _with_mtp(plain_ckpt, tmp_path, {n: t for n, t in mtp_tensors.items() if n != dropped})
    with pytest.raises(CheckpointError, match=dropped):
        _load(path)


# --- forward -------------------------------------------------------------------------------------
class Run:
    """Ragged steps over fresh zeroed caches (main and MTP), one state slot and shuffled blocks per sequence."""

    def __init__(self, model: DeepseekV4ForCausalLM, seqs: list[list[int]], num_blocks: int = 32):
        self.model, self.seqs, self.done = model, seqs, [0] * len(seqs)
        specs = model.kv_cache_spec(BLOCK, include_mtp=True)
        model.bind_kv_cache({s.name: torch.zeros((num_blocks if s.kind == "paged" else len(seqs), *s.shape),
                                                 dtype=s.dtype) for s in specs})
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        width = -(-max(len(s) for s in seqs) // BLOCK)
        self.table = torch.tensor([order[r * width:(r + 1) * width] for r in range(len(seqs))])

    def meta(self, counts: list[int]) -> ForwardMeta:
        starts = list(self.done)
        ends = [s + c for s, c in zip(starts, counts)]
        self.done = ends
        pos = [list(range(s, e)) for s, e in zip(starts, ends)]
        qs = [0]
        for c in counts:
            qs.append(qs[-1] + c)
        return ForwardMeta(
            input_ids=torch.tensor([self.seqs[r][p] for r, ps in enumerate(pos) for p in ps]),
            positions=torch.tensor([p for ps in pos for p in ps]),
            token_req=torch.tensor([r for r, ps in enumerate(pos) for _ in ps]),
            block_table=self.table, state_slots=torch.arange(len(self.seqs)),
            logits_indices=torch.tensor(qs[1:]) - 1, query_start=qs, seq_starts=starts, seq_lens=ends,
            block_size=BLOCK)

    def next_ids(self, meta: ForwardMeta, k: int) -> torch.Tensor:
        """Token t + 1 + k for every row at position t (0 past the end: the caller masks those rows)."""
        seqs = self.seqs
        return torch.tensor([seqs[r][t + 1 + k] if t + 1 + k < len(seqs[r]) else 0
                             for r, t in zip(meta.token_req.tolist(), meta.positions.tolist())])

    def step(self, counts: list[int]) -> list[torch.Tensor]:
        """Main and every MTP layer's hidden rows of this step, each [T, D]."""
        meta = self.meta(counts)
        hidden, streams = self.model(meta, return_mtp_input=True)
        out = [hidden]
        for k in range(len(self.model.mtp)):
            h, streams = self.model.mtp_forward(k, streams, self.next_ids(meta, k), meta, return_mtp_input=True)
            out.append(h)
        return out


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
    _randomise(other.mtp, seed=8)
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
