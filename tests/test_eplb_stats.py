"""Expert-load statistics (eplb/stats.py): the window, balancedness, the stats file, `deepinfer eplb`, and the
load a DP2 + EP engine records against the routing of one process."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.eplb import load_placement, validate_placement
from deepinfer.eplb.stats import ExpertLoad, layer_balancedness, load_expert_load, save_expert_load


def test_window_keeps_the_last_steps():
    load = ExpertLoad(num_layers=2, num_experts=4, window=2)
    load.record(0, torch.tensor([[0, 1], [1, 3]]))
    load.end_step()
    load.record(1, torch.tensor([2]))
    assert load.totals().tolist() == [[1, 2, 0, 1], [0, 0, 1, 0]]
    load.end_step()  # the first step leaves the window
    load.record(0, torch.tensor([3]))
    assert load.totals().tolist() == [[0, 0, 0, 1], [0, 0, 1, 0]]
    with pytest.raises(ValueError, match="window"):
        ExpertLoad(1, 1, 0)


def test_balancedness_is_mean_over_max_per_rank():
    load = torch.tensor([[3, 1, 2, 2], [0, 0, 0, 0]])
    assert layer_balancedness(load, (0, 2, 4)) == [1.0, 1.0]
    assert layer_balancedness(torch.tensor([[6, 0, 1, 1]]), (0, 2, 4)) == [pytest.approx(4 / 6)]


def test_stats_file_round_trip_and_errors(tmp_path):
    save_expert_load(tmp_path / "load.json", torch.tensor([[1, 2], [3, 4]]))
    assert load_expert_load(tmp_path / "load.json").tolist() == [[1, 2], [3, 4]]
    (tmp_path / "bad.json").write_text(json.dumps({"expert_load": [[1], [1, 2]]}))
    with pytest.raises(ValueError, match="expected"):
        load_expert_load(tmp_path / "bad.json")


def test_stats_from_a_metrics_scrape(tmp_path):
    """/metrics exports the window per (engine, layer, expert); `deepinfer eplb --stats` reads a saved scrape,
    summing the engines (replicas serving one model)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from deepinfer.engine.messages import EngineStats
    from deepinfer.eplb.stats import PROMETHEUS_METRIC
    from deepinfer.server.metrics import EXPERT_LOAD_METRIC, PREFIX, _EngineStatsCollector

    assert PREFIX + EXPERT_LOAD_METRIC == PROMETHEUS_METRIC
    load = [[5, 0, 7], [1, 2, 3]]
    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0.0, eplb_expert_load=load)
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(lambda: {"0": stats}))
    (tmp_path / "scrape.txt").write_bytes(generate_latest(registry))
    assert load_expert_load(tmp_path / "scrape.txt").tolist() == load
    two = CollectorRegistry()
    two.register(_EngineStatsCollector(lambda: {"0": stats, "1": stats}))
    (tmp_path / "two.txt").write_bytes(generate_latest(two))
    assert load_expert_load(tmp_path / "two.txt").tolist() == [[2 * t for t in row] for row in load]
    (tmp_path / "empty.txt").write_text("# nothing here\n")
    with pytest.raises(ValueError, match="no deepinfer:eplb_expert_load samples"):
        load_expert_load(tmp_path / "empty.txt")


def test_offline_placement_from_recorded_load(tmp_path, capsys):
    """Skewed load (two hot experts on rank 0): the placement balances it better than the contiguous one."""
    load = torch.tensor([[100, 90, 5, 5, 5, 5, 5, 5]] * 3)
    save_expert_load(tmp_path / "load.json", load)
    out = tmp_path / "placement.json"
    assert main(["eplb", "--stats", str(tmp_path / "load.json"), "--num-gpus", "4",
                 "--num-redundant-experts", "4", "--out", str(out)]) == 0
    phy2log = load_placement(out, num_gpus=4, num_logical=8)
    validate_placement(phy2log, num_gpus=4, num_logical=8)
    before, after = capsys.readouterr().out.split("balancedness: contiguous ")[1].split(" -> placement ")
    assert float(after.split()[0]) > float(before) + 0.3


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=3), tmp_path_factory.mktemp("v4"))


def _routed_counts(llm: LLM, prompts, params) -> torch.Tensor:
    """Per MoE layer and expert, the (token, k) routings of one process's gates over the run."""
    model, counts = llm.engine.model, []
    for i, layer in enumerate(model.layers):
        counts.append(torch.zeros(model.config.n_routed_experts, dtype=torch.long))
        forward = layer.ffn.gate.forward

        def counted(x, token_ids, forward=forward, row=counts[i]):
            ids, weights = forward(x, token_ids)
            row += torch.bincount(ids.flatten(), minlength=row.numel())
            return ids, weights
        layer.ffn.gate.forward = counted
    llm.generate(prompts, params, use_tqdm=False)
    return torch.stack(counts)


def test_ep_engine_records_the_routing_of_one_process(v4_ckpt):
    """Each rank records its own tokens only (no dummy rounds), so the sum over ranks is the global load."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 17, 5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=16, load_progress=False, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
    want = _routed_counts(LLM(v4_ckpt, **options), prompts, params)
    with LLM(v4_ckpt, **options, data_parallel_size=2, enable_expert_parallel=True) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        got = llm.expert_load()
        balance = llm.engine.executor.expert_balancedness()
    assert torch.equal(got[:len(want)], want)  # the main layers' MoE tags come first
    assert not got[len(want):].any()  # the checkpoint's MTP layer (its own tag) never ran: no drafting
    assert len(balance) == len(got) and all(0 < b <= 1 for b in balance)
