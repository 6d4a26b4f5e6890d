"""The MLA model (V3 / V2) sharded over ranks (TP and EP, gloo on loopback) against the single-process model on
the same checkpoint, both in fp32 with one intra-op thread.

Tiny checkpoints have 9 routed experts (3 groups of 3, group-limited routing), so EP over 2 or 4 ranks places
them unevenly (5 + 4; 3 + 2 + 2 + 2); the V3 one carries an MTP layer. Ranks run mla_parallel_workers.Script:
a ragged prefill with a chunked prompt, then absorbed decode steps, calling finish_step after every step.

Exactness: TP splits the o_proj / MLP sums over ranks (within 1e-4 asserted). EP with one busy rank is
bit-identical: its GEMMs follow the global expert plan, which is its own, and with top-2 routing a token's two
weighted terms are added once whichever ranks hold them (0 + a + b either way). With two busy ranks the plan
counts both ranks' tokens, so the padded expert GEMMs may have another shape than the single run's: within 1e-4.
"""

from __future__ import annotations

import contextlib
import json

import mla_parallel_workers as workers
import pytest
import torch
from mla_parallel_workers import Case, Script
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig, ParallelConfig
from deepinfer.distributed.launcher import WorkerGroup, WorkerOptions
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.distributed.moe_comm import place_experts
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.models.loader import CheckpointError, iter_checkpoint
from deepinfer.models.mla_mtp import MLAMTPLayer

OPTIONS = WorkerOptions(pg_timeout_s=workers.GROUP_TIMEOUT_S, heartbeat_s=0.2, hang_timeout_s=30, join_timeout_s=3)
TOL = 1e-4
ODD_EXPERTS = dict(n_routed_experts=9, n_group=3, topk_group=2)
COMMS = ("allgather", "alltoall")
SCRIPT_A = Script(workers.prompts(1, (9, 5, 12)))
SCRIPT_B = Script(workers.prompts(2, (6, 11)), decode_steps=3)
MTP_A = Script(SCRIPT_A.prompts, mtp=True)


@contextlib.contextmanager
def one_thread():
    """The ranks' intra-op thread count (GEMM bits depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _add_mtp_shard(path, seed: int = 7) -> None:
    """A random MTP layer as `model.layers.{N}.*` in a second shard, with the duplicated embedding / head."""
    cfg = ModelConfig.from_hf(path)
    layer, g, prefix, tensors = MLAMTPLayer(cfg, 0, torch.float32, "cpu"), torch.Generator().manual_seed(seed), \
        f"model.layers.{cfg.num_layers}.", {}
    for name, t in layer._targets().items():
        t = (name.endswith("norm.weight") + 0.05 * torch.randn(t.shape, generator=g)).float()
        if name.endswith("experts.w13"):
            for e, (gate, up) in enumerate(w.chunk(2) for w in t):
                tensors |= {f"{prefix}mlp.experts.{e}.gate_proj.weight": gate,
                            f"{prefix}mlp.experts.{e}.up_proj.weight": up}
        elif name.endswith("experts.w2"):
            tensors |= {f"{prefix}mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(t)}
        else:
            tensors[prefix + name] = t
    main = load_file(path / "model.safetensors")
    tensors |= {prefix + "embed_tokens.weight": main["model.embed_tokens.weight"],
                prefix + "shared_head.head.weight": main["lm_head.weight"]}
    _write_two_shards(path, main, {n: t.contiguous() for n, t in tensors.items()})


def _write_two_shards(path, main: dict, extra: dict) -> None:
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    (path / "model.safetensors").rename(path / shards[0])
    save_file(extra, path / shards[1])
    names = {n: shards[0] for n in main} | {n: shards[1] for n in extra}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    from tiny_models import make_reference, save_reference

    path = save_reference(make_reference("v3", seed=3, **ODD_EXPERTS), tmp_path_factory.mktemp("v3p") / "model")
    _add_mtp_shard(path)
    return path


@pytest.fixture(scope="module")
def v2_path(tmp_path_factory):
    from tiny_models import make_reference, save_reference

    return save_reference(make_reference("v2", seed=4, **ODD_EXPERTS), tmp_path_factory.mktemp("v2p") / "model")


def reference(path, script: Script) -> dict:
    with one_thread():
        return workers.run_script(workers.load(str(path)), script)


def run_world(parallel: ParallelConfig, cases: list[Case], timeout_s: float = 120) -> list[list[dict]]:
    """results[rank][case]"""
    with WorkerGroup(workers.run_cases, parallel, (cases,), OPTIONS) as group:
        return group.wait(timeout_s)


def assert_matches(out: dict, ref: dict, exact: bool = False) -> None:
    """Every step's logits (bit-identical when exact, else within TOL), the same greedy tokens, MTP logits."""
    pairs = list(zip(out["logits"], ref["logits"])) + ([(out["mtp"], ref["mtp"])] if ref["mtp"] is not None else [])
    assert len(out["logits"]) == len(ref["logits"]) and (out["mtp"] is None) == (ref["mtp"] is None)
    for got, want in pairs:
        assert got.shape == want.shape
        if exact:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max().item() < TOL
    assert out["tokens"] == ref["tokens"]


# ------------------------------------------------------------------------------------------------- no ranks


def test_single_is_the_default_handle(v2_path):
    model = workers.load(str(v2_path))
    assert model.parallel.is_single and model.parallel.finish_step() == 0


def test_heads_must_divide_over_tp(v2_path):
    with pytest.raises(ValueError, match="num_attention_heads: heads 4 is not divisible by tensor-parallel size 3"):
        DeepseekV3ForCausalLM(ModelConfig.from_hf(v2_path), parallel=ModelParallel(tp_rank=0, tp_size=3))


def _ep_rank_model(path, rank: int) -> DeepseekV3ForCausalLM:
    """EP rank `rank` of 2 without process groups: construction and loading run no collective."""
    cfg = ModelConfig.from_hf(path)
    return DeepseekV3ForCausalLM(cfg, parallel=ModelParallel(placement=place_experts(9, 2), ep_rank=rank))


def test_an_ep_rank_loads_only_its_experts_and_builds_mtp_at_load(v3_path):
    ckpt = {n: t for n, t, _ in iter_checkpoint(v3_path, "deepseek_v3")}
    model = _ep_rank_model(v3_path, 1)
    model.load_weights((n, t, "x") for n, t in ckpt.items())
    w13 = model.model.layers[1].mlp.experts.w13  # rank 1 holds experts 5..8
    assert w13.shape[0] == 4
    gate_up = [ckpt[f"model.layers.1.mlp.experts.5.{p}.weight"] for p in ("gate_proj", "up_proj")]
    assert torch.equal(w13[0], torch.cat(gate_up))
    mtp_w2 = model.mtp[0].block.mlp.experts.w2
    assert mtp_w2.shape[0] == 4 and torch.equal(mtp_w2[3], ckpt["model.layers.3.mlp.experts.8.down_proj.weight"])
    assert model.mtp_loaded and not model.mtp_weights  # the kept MTP tensors were freed once built


def _fused(ckpt: dict[str, torch.Tensor], pre: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory layout of one layer's experts: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""
    part = {p: torch.stack([ckpt.pop(f"{pre}.{e}.{p}.weight") for e in range(9)]) for p in ("gate_proj", "up_proj",
                                                                                            "down_proj")}
    return {f"{pre}.gate_up_proj": torch.cat([part["gate_proj"], part["up_proj"]], 1), f"{pre}.down_proj":
            part["down_proj"]}


def test_an_ep_rank_slices_fused_expert_tensors_like_per_expert_ones(v3_path):
    ckpt = {n: t for n, t, _ in iter_checkpoint(v3_path, "deepseek_v3")}
    per_expert, fused = _ep_rank_model(v3_path, 0), _ep_rank_model(v3_path, 0)
    per_expert.load_weights((n, t, "x") for n, t in ckpt.items())
    for pre in ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts", "model.layers.3.mlp.experts"):
        ckpt |= _fused(ckpt, pre)
    fused.load_weights((n, t, "x") for n, t in ckpt.items())
    a, b = per_expert.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("dropped, match", [
    ("model.layers.2.mlp.experts.0.up_proj.weight", r"missing 1 tensors, e.g. model\.layers\.2\.mlp\.experts\.0\."),
    ("model.layers.3.mlp.experts.1.gate_proj.weight", r"MTP layer 'model\.layers\.3\.' is missing 1 .*experts\.1\."),
    ("model.layers.3.self_attn.kv_b_proj.weight", r"MTP layer .* missing 1 tensors, .*kv_b_proj")],
    ids=["own_expert", "own_mtp_expert", "mtp_attention"])
def test_an_ep_rank_requires_its_own_tensors(v3_path, dropped, match):
    """Experts 0..4 live on rank 0: a checkpoint without one of them is incomplete there. Rank 1 never reads them
    (the engine's loader skips them unread: weights.wanted_names), so it loads without them."""
    partial = [w for w in iter_checkpoint(v3_path, "deepseek_v3") if w[0] != dropped]
    with pytest.raises(CheckpointError, match=match):
        _ep_rank_model(v3_path, 0).load_weights(iter(partial))
    if ".experts." in dropped:
        _ep_rank_model(v3_path, 1).load_weights(iter(partial))


# ------------------------------------------------------------------------------------------------- TP 2


@pytest.fixture(scope="module")
def tp2(v3_path, v2_path):
    return run_world(ParallelConfig(1, 2), [Case(str(v3_path), "allgather", (MTP_A,)),
                                            Case(str(v2_path), "allgather", (SCRIPT_B,))])


@pytest.mark.parametrize("case", [0, 1], ids=["v3_with_mtp", "v2"])
def test_tp2_matches_one_process(tp2, v3_path, v2_path, case):
    path, script = [(v3_path, MTP_A), (v2_path, SCRIPT_B)][case]
    ref = reference(path, script)
    for rank in range(2):
        assert_matches(tp2[rank][case], ref)
        assert all(r == 0 for r in tp2[rank][case]["rounds"])  # TP only: finish_step joins nothing
    assert tp2[0][case]["expert_numel"] == tp2[1][case]["expert_numel"]  # experts split by rows, evenly


# ------------------------------------------------------------------------------------------------- DP 2 + EP


def _ep_cases(path) -> list[Case]:
    """Per comm kind: both replicas busy; replica 1 idle; replica 0 drafts with MTP while replica 1 does not."""
    return [Case(str(path), comm, scripts) for comm in COMMS
            for scripts in ((SCRIPT_A, SCRIPT_B), (SCRIPT_A, None), (MTP_A, SCRIPT_B))]


@pytest.fixture(scope="module")
def ep2(v3_path):
    return run_world(ParallelConfig(2, 1, enable_expert_parallel=True), _ep_cases(v3_path))


@pytest.fixture(scope="module")
def ep_refs(v3_path):
    return {s: reference(v3_path, s) for s in (SCRIPT_A, SCRIPT_B, MTP_A)}


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_busy_replicas_match_one_process_each(ep2, ep_refs, comm):
    c = 3 * COMMS.index(comm)
    assert_matches(ep2[0][c], ep_refs[SCRIPT_A])
    assert_matches(ep2[1][c], ep_refs[SCRIPT_B])


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_idle_replica_only_finishes_steps_and_the_busy_one_is_bit_identical(ep2, ep_refs, comm):
    c = 3 * COMMS.index(comm) + 1
    assert_matches(ep2[0][c], ep_refs[SCRIPT_A], exact=True)
    # the idle rank joined rank 0's two MoE layers in every step; rank 0 itself had nothing left to drain
    assert ep2[1][c]["rounds"] == [2] * SCRIPT_A.num_steps and set(ep2[0][c]["rounds"]) == {0}


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_mtp_on_one_replica_only(ep2, ep_refs, comm):
    c = 3 * COMMS.index(comm) + 2
    assert_matches(ep2[0][c], ep_refs[MTP_A])
    assert_matches(ep2[1][c], ep_refs[SCRIPT_B])
    assert ep2[1][c]["rounds"][0] == 1  # rank 1 ran rank 0's MTP MoE round inside finish_step
    assert ep2[0][c]["tags"] == ep2[1][c]["tags"] == 3  # two main MoE layers and the MTP one, on both ranks


def test_ep2_expert_parameters_split_over_the_world(ep2, v3_path):
    single = workers.expert_numel(workers.load(str(v3_path)))
    per_rank = [ep2[r][0]["expert_numel"] for r in range(2)]
    assert per_rank == [single * 5 // 9, single * 4 // 9]  # 9 experts placed 5 + 4


# ------------------------------------------------------------------------------------------------- DP 2 x TP 2 + EP


@pytest.mark.slow
def test_world4_dp2_tp2_ep_matches_one_process(v3_path, ep_refs):
    cases = [Case(str(v3_path), "alltoall", (SCRIPT_A, SCRIPT_B)), Case(str(v3_path), "allgather", (MTP_A, None))]
    results = run_world(ParallelConfig(2, 2, enable_expert_parallel=True), cases, timeout_s=240)
    for rank in range(4):
        replica = rank // 2
        assert_matches(results[rank][0], ep_refs[(SCRIPT_A, SCRIPT_B)[replica]])
        if replica == 0:
            assert_matches(results[rank][1], ep_refs[MTP_A])
        else:
            assert results[rank][1]["rounds"] == [3] + [2] * (MTP_A.num_steps - 1)
    single = workers.expert_numel(workers.load(str(v3_path)))
    assert [results[r][0]["expert_numel"] for r in range(4)] == [single * n // 9 for n in (3, 2, 2, 2)]
