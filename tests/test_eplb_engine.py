"""EPLB in the multi-rank engine: greedy tokens with live rebalancing (and redundant experts) equal to the
engine without it and to one process; static placement files; clear errors for bad EPLB options.

World 2 and world 4 with tiny V4 run by default; world 4 with tiny V3 is marked slow."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.eplb import save_placement

OPTIONS = dict(block_size=16, load_progress=False, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False,
               distributed_timeout_s=60)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=3), tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    return save_reference(make_reference("v3", seed=4), tmp_path_factory.mktemp("v3"))


def prompts() -> list[list[int]]:
    """Random prompts plus a repetitive one (its tokens route to the same experts: a skewed load)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 17, 5)] + [[42, 43] * 12]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(ckpt, **options):
    """(greedy tokens, every rank's stats) of one engine over prompts()."""
    with LLM(ckpt, **OPTIONS, **options) as llm:
        out = tokens(llm.generate(prompts(), PARAMS, use_tqdm=False))
        return out, (llm.engine.executor.rank_stats() if llm.engine.executor is not None else None)


@pytest.fixture(scope="module")
def v4_single(v4_ckpt):
    return run(v4_ckpt)[0]


def ep(world: int, comm: str = "alltoall", **eplb) -> dict:
    return dict(data_parallel_size=world, enable_expert_parallel=True, moe_comm=comm, **eplb)


LIVE = dict(enable_eplb=True, eplb_step_interval=3, eplb_layers_per_step=2)


def check_rebalanced(stats, world: int, slots: int) -> None:
    """Every rank moved the same layers, and the layers now run non-contiguous placements of `slots` slots."""
    counters = [s.eplb for s in stats]
    assert all(c == counters[0] | {"move_seconds": c["move_seconds"]} for c in counters)
    assert counters[0]["rebalances"] >= 2 and counters[0]["layers_moved"] > 0
    placements = [s.expert_placement for s in stats]
    assert all(p == placements[0] for p in placements)  # one placement per layer, on every rank
    assert all(len(row) == slots for row in placements[0])
    assert any(row != list(range(slots)) for row in placements[0])
    after, before = counters[0]["balancedness_after"], counters[0]["balancedness_before"]
    assert sum(after) >= sum(before)


@pytest.mark.parametrize("comm", ["alltoall", "allgather"])
def test_live_eplb_with_redundant_experts_keeps_greedy_tokens(v4_ckpt, v4_single, comm):
    got, stats = run(v4_ckpt, **ep(2, comm, num_redundant_experts=2, **LIVE))
    assert got == v4_single
    check_rebalanced(stats, 2, 8 + 2)
    assert stats[0].eplb["experts_moved"] > 0
    # the ranks' slots together computed every routed (token, k) row once (the window holds every step)
    routed = torch.stack([torch.tensor(s.expert_load) for s in stats]).sum(0).sum(1)
    assert [sum(rows) for rows in zip(*(s.rows_served for s in stats))] == routed.tolist()


def test_live_eplb_under_two_batch_overlap(v4_ckpt, v4_single):
    """Two lanes drain on two threads; the step (and any weight move) ends once both are done."""
    got, stats = run(v4_ckpt, **ep(2, two_batch_overlap=True, num_redundant_experts=2, **LIVE))
    assert got == v4_single
    check_rebalanced(stats, 2, 8 + 2)


def test_live_eplb_with_mtp_speculation(v4_ckpt, v4_single, tmp_path):
    """The MTP layer's experts are a layer of their own: drafting loads them, and EPLB balances them too."""
    from test_spec_decode import _with_mtp

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    got, stats = run(_with_mtp(v4_ckpt, tmp_path / "mtp"), speculative_config=spec,
                     **ep(2, num_redundant_experts=2, **LIVE))
    assert got == v4_single  # speculation is lossless: the plain model's greedy tokens
    check_rebalanced(stats, 2, 8 + 2)
    assert sum(s.rows_served[-1] for s in stats) > 0  # the MTP layer's experts ran


def test_static_placement_file(v4_ckpt, v4_single, tmp_path):
    """A placement file (as `deepinfer eplb` writes) is served as given, with its redundant slots."""
    rows = torch.tensor([[7, 6, 5, 4, 3], [2, 1, 0, 7, 7]]).T.reshape(-1)  # expert 7 three times
    phy2log = torch.stack([rows.roll(i) for i in range(5)])  # 4 MoE layers + the MTP layer's
    save_placement(tmp_path / "placement.json", phy2log, num_gpus=2)
    got, stats = run(v4_ckpt, **ep(2, eplb_placement=str(tmp_path / "placement.json"), num_redundant_experts=2))
    assert got == v4_single
    assert stats[0].expert_placement == phy2log.tolist() and stats[0].eplb["rebalances"] == 0


def test_bad_eplb_options_fail_clearly(v4_ckpt, tmp_path):
    save_placement(tmp_path / "short.json", torch.arange(8).unsqueeze(0), num_gpus=2)  # one layer
    with pytest.raises(Exception, match="MoE layers"):
        LLM(v4_ckpt, **OPTIONS, **ep(2, eplb_placement=str(tmp_path / "short.json")))
    with pytest.raises(Exception, match="do not split evenly"):
        LLM(v4_ckpt, **OPTIONS, **ep(2, num_redundant_experts=1))
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        LLM(v4_ckpt, **OPTIONS, enable_eplb=True)
    with pytest.raises(ValueError, match="eplb_step_interval"):
        LLM(v4_ckpt, **OPTIONS, **ep(2, enable_eplb=True, eplb_step_interval=0))


@pytest.mark.parametrize("kind", ["v4", pytest.param("v3", marks=pytest.mark.slow)])
def test_world4_live_eplb_keeps_greedy_tokens(kind, v4_ckpt, v3_ckpt, v4_single):
    """The issue's check: EP 4, rebalancing every few steps during generation, with and without redundant
    experts, against the same layout without EPLB and one process."""
    ckpt = v4_ckpt if kind == "v4" else v3_ckpt
    single = v4_single if kind == "v4" else run(ckpt)[0]
    off, _ = run(ckpt, **ep(4))
    live, stats = run(ckpt, **ep(4, **LIVE))
    redundant, stats_r = run(ckpt, **ep(4, num_redundant_experts=4, **LIVE))
    assert off == single and live == single and redundant == single
    check_rebalanced(stats_r, 4, 12)
    assert stats[0].eplb["rebalances"] >= 2
