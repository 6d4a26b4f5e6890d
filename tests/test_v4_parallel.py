"""DeepSeek-V4 sharded over ranks (gloo on loopback): tensor parallelism, expert parallelism with DP replicas
running different sequences or idling, and sharded loading, against the single-process model on the same
checkpoint (fp32, one intra-op thread: v4_workers.py).

The tiny checkpoint has 5 routed experts (odd: the EP blocks are 3 + 2 on two ranks, 2 + 1 + 1 + 1 on four) and
random MTP tensors. Every run is a ragged prefill then greedy decode steps with caches bound, main and MTP
logits compared. Tolerances: TP splits sums (wo_b, shared expert, experts' intermediate dim) and EP with two
busy replicas batches the expert GEMMs over both replicas' tokens, so those match within 1e-4 (max abs); with
one replica idle the expert GEMMs have the single-process shapes and top-2 sums add in the same order, so the
busy replica's logits are bit-identical."""

from __future__ import annotations

import pytest
import torch
import v4_workers
from tiny_models import make_reference, save_reference
from v4_runs import random_mtp_tensors, write_shards
from v4_workers import DECODE_STEPS, GROUP_TIMEOUT_S, SCENARIOS

from deepinfer.config import ModelConfig, ParallelConfig
from deepinfer.distributed.launcher import WorkerGroup, WorkerOptions
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

OPTIONS = WorkerOptions(pg_timeout_s=GROUP_TIMEOUT_S, heartbeat_s=0.2, hang_timeout_s=30, join_timeout_s=3)
EXPERTS = 5
MAIN_LAYERS = 4  # every V4 layer is MoE; the one MTP layer adds a fifth
TOL = 1e-4
COMMS = ["allgather", "alltoall"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = save_reference(make_reference("v4", seed=4, n_routed_experts=EXPERTS), tmp_path_factory.mktemp("v4par"))
    write_shards(path, random_mtp_tensors(ModelConfig.from_hf(path)))
    return path


def _world(parallel: ParallelConfig, ckpt, comms: list[str], scenarios: list[str], timeout_s: float) -> list[dict]:
    with WorkerGroup(v4_workers.v4_world, parallel, (str(ckpt), comms, scenarios), OPTIONS) as group:
        return group.wait(timeout_s)


def _max_diff(run: dict) -> float:
    """Worst |sharded - reference| over every step's main and MTP logits; the greedy tokens must agree."""
    assert run["sharded"]["tokens"] == run["ref"]["tokens"]
    assert all(len(t) == 1 + DECODE_STEPS for t in run["ref"]["tokens"])
    pairs = [(a, b) for sa, sb in zip(run["sharded"]["logits"], run["ref"]["logits"]) for a, b in zip(sa, sb)]
    assert len(pairs) == (1 + DECODE_STEPS) * len(run["ref"]["logits"][0]) and all(a.shape == b.shape for a, b in pairs)
    return max((a - b).abs().max().item() for a, b in pairs)


def _bit_identical(run: dict) -> bool:
    return all(torch.equal(a, b) for sa, sb in zip(run["sharded"]["logits"], run["ref"]["logits"])
               for a, b in zip(sa, sb))


# ------------------------------------------------------------------------------------------------- TP 2


@pytest.fixture(scope="module")
def tp2(ckpt):
    return _world(ParallelConfig(1, 2), ckpt, COMMS[:1], ["dp"], 120)


def test_tp2_logits_match_single_process(tp2):
    for out in tp2:
        run = out["allgather"]["dp"]
        assert len(run["ref"]["logits"][0]) == 2  # main and the MTP layer
        assert _max_diff(run) < TOL
        assert run["sharded"]["rounds"] == [0] * (1 + DECODE_STEPS)  # finish_step is a no-op without EP
    assert all(torch.equal(a, b) for a, b in zip(tp2[0]["allgather"]["dp"]["sharded"]["logits"][-1],
                                                 tp2[1]["allgather"]["dp"]["sharded"]["logits"][-1]))


def test_tp2_stores_its_slices_of_the_split_tensors(tp2):
    for out in tp2:
        storage = out["allgather"]["storage"]
        assert storage["numel"] * 2 == storage["full_numel"]  # experts split along the intermediate dim
        assert storage["local"] == [(0, EXPERTS)] * (MAIN_LAYERS + 1)  # every expert, main and MTP layers
        assert storage["exact"] and storage["same_cache"]  # the one MQA KV head is not split
        assert storage["params"] < 0.75 * storage["full_params"]


def test_tp2_forward_reduces_once_per_attention_and_once_per_moe(tp2):
    """embed + (wo_b, routed + shared expert folded) per layer all-reduce; the LM head all-gathers."""
    assert all(out["allgather"]["collectives"] == {"all_reduce": 1 + 2 * MAIN_LAYERS, "all_gather": 1}
               for out in tp2)


def test_tp_sizes_that_do_not_divide_heads_or_groups_are_named(ckpt):
    config = ModelConfig.from_hf(ckpt)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) and o_groups \(2\) divisible by the "
                                         r"tensor-parallel size 3"):
        DeepseekV4ForCausalLM(config, parallel=ModelParallel(tp_rank=0, tp_size=3))


# ------------------------------------------------------------------------------------------------- DP 2 + EP


@pytest.fixture(scope="module")
def ep2(ckpt):
    return _world(ParallelConfig(2, 1, enable_expert_parallel=True), ckpt, COMMS, list(SCENARIOS), 150)


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_replicas_with_different_sequences_match_their_single_process_runs(ep2, comm):
    for out in ep2:
        run = out[comm]["dp"]
        assert _max_diff(run) < TOL
        assert run["sharded"]["rounds"] == [0] * (1 + DECODE_STEPS)  # equal MoE calls: nothing left to join


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_idle_replica_only_finishes_steps_and_the_busy_one_is_bit_identical(ep2, comm):
    busy, idle = ep2[0][comm]["idle"], ep2[1][comm]["idle"]
    assert _bit_identical(busy)
    assert busy["sharded"]["rounds"] == [0] * (1 + DECODE_STEPS)
    assert idle["rounds"] == [MAIN_LAYERS] * (1 + DECODE_STEPS)  # the busy replica's MoE calls (no MTP)


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_replica_without_mtp_drains_through_the_others_mtp_moe(ep2, comm):
    with_mtp, without = ep2[0][comm]["mtp_extra"], ep2[1][comm]["mtp_extra"]
    assert len(with_mtp["ref"]["logits"][0]) == 2 and len(without["ref"]["logits"][0]) == 1
    assert _max_diff(with_mtp) < TOL and _max_diff(without) < TOL
    assert without["sharded"]["rounds"] == [1] * (1 + DECODE_STEPS)  # the MTP layer's one MoE round per step


@pytest.mark.parametrize("comm", COMMS)
def test_ep2_ranks_store_only_their_experts(ep2, comm):
    blocks = [(0, 3), (3, 5)]  # 5 experts over 2 ranks
    for rank, out in enumerate(ep2):
        storage = out[comm]["storage"]
        assert storage["local"] == [blocks[rank]] * (MAIN_LAYERS + 1) and storage["exact"] and storage["same_cache"]
        width = blocks[rank][1] - blocks[rank][0]
        assert storage["numel"] * EXPERTS == storage["full_numel"] * width
    assert sum(out[comm]["storage"]["numel"] for out in ep2) == ep2[0][comm]["storage"]["full_numel"]


# ------------------------------------------------------------------------------------------------- DP 2 x TP 2 + EP


def _check_world4(results: list[dict], comm: str, scenarios: list[str]) -> None:
    blocks = [(0, 2), (2, 3), (3, 4), (4, 5)]
    for rank, out in enumerate(results):
        assert out[comm]["storage"]["local"] == [blocks[rank]] * (MAIN_LAYERS + 1) and out[comm]["storage"]["exact"]
        for name in scenarios:
            run = out[comm][name]
            if "sharded" in run:  # the idle replica (ranks 2, 3 in "idle") has only rounds
                assert _max_diff(run) < TOL, (rank, name)


def test_world4_dp2_tp2_ep_allgather_matches_single_process(ckpt):
    results = _world(ParallelConfig(2, 2, enable_expert_parallel=True), ckpt, COMMS[:1], ["dp"], 240)
    _check_world4(results, "allgather", ["dp"])


@pytest.mark.slow
def test_world4_dp2_tp2_ep_alltoall_every_scenario(ckpt):
    results = _world(ParallelConfig(2, 2, enable_expert_parallel=True), ckpt, COMMS[1:], list(SCENARIOS), 400)
    _check_world4(results, "alltoall", list(SCENARIOS))
