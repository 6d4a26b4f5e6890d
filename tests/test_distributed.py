"""deepinfer/distributed: the rank layout (pure), backends and groups, the WorkerGroup launcher (failure
detection in bounded time, no orphans) and torchrun on loopback. Processes use 127.0.0.1 only and every wait
is bounded; world-4 tests are slow-marked (they oversubscribe a 2-core machine)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_workers
import pytest
import torch

import deepinfer.distributed.backend as backend
from deepinfer.config import ParallelConfig
from deepinfer.distributed.check import verify_world
from deepinfer.distributed.launcher import WorkerFailure, WorkerGroup, WorkerOptions, describe_exit
from deepinfer.distributed.layout import make_layout

ROOT = Path(__file__).resolve().parents[1]
FAST = WorkerOptions(pg_timeout_s=10, heartbeat_s=0.2, hang_timeout_s=30, join_timeout_s=3)


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by a reparenting init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _within(seconds: float, cond) -> bool:
    """Poll `cond` until it holds or `seconds` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def _gone_within(pids: list[int], seconds: float) -> bool:
    return _within(seconds, lambda: not any(_alive(p) for p in pids))


def _env() -> dict[str, str]:
    """Children import this checkout of deepinfer (and tests/ for dist_workers)."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------------- layout


def test_layout_2x2_with_expert_parallel():
    layout = make_layout(ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True))
    assert layout.world_size == 4
    assert layout.tp_groups == ((0, 1), (2, 3))
    assert layout.dp_groups == ((0, 2), (1, 3))
    assert layout.ep_group == (0, 1, 2, 3)
    assert [(layout.dp_rank(r), layout.tp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.tp_group(3) == (2, 3) and layout.dp_group(3) == (1, 3) and layout.ep_rank(3) == 3


def test_layout_without_expert_parallel_has_no_ep_group():
    layout = make_layout(ParallelConfig(3, 2), world_size=6)
    assert layout.ep_group is None and layout.ep_rank(5) is None
    assert layout.tp_groups == ((0, 1), (2, 3), (4, 5)) and layout.dp_groups == ((0, 2, 4), (1, 3, 5))


@pytest.mark.parametrize("d,t", [(1, 1), (1, 4), (4, 1), (2, 3), (3, 4)])
def test_layout_groups_partition_the_world(d, t):
    layout = make_layout(ParallelConfig(d, t))
    for groups, size in ((layout.tp_groups, t), (layout.dp_groups, d)):
        assert sorted(r for g in groups for r in g) == list(range(d * t))
        assert all(len(g) == size for g in groups)
    for r in range(d * t):
        assert set(layout.tp_group(r)) & set(layout.dp_group(r)) == {r}
        assert layout.tp_group(r)[layout.tp_rank(r)] == r and layout.dp_group(r)[layout.dp_rank(r)] == r


@pytest.mark.parametrize("kwargs", [{"data_parallel_size": 0}, {"tensor_parallel_size": -1},
                                    {"tensor_parallel_size": 1.5}, {"data_parallel_size": True},
                                    {"enable_expert_parallel": 1}])
def test_parallel_config_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="must be"):
        ParallelConfig(**kwargs)


def test_layout_rejects_world_mismatch_and_bad_rank():
    with pytest.raises(ValueError, match=r"world size 3 does not match .* 2 x tensor_parallel_size 2 = 4"):
        make_layout(ParallelConfig(2, 2), world_size=3)
    layout = make_layout(ParallelConfig(1, 2))
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
            layout.dp_rank(bad)


# ------------------------------------------------------------------------------------------------- backend


def test_backend_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.choose_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert backend.choose_backend() == "cpu:gloo,cuda:nccl"


def test_dist_env_from_torchrun_variables():
    env = backend.DistEnv(rank=3, world_size=4, master_addr="127.0.0.1", master_port=1234, local_rank=1)
    assert backend.DistEnv.from_env(env.to_environ()) == env
    with pytest.raises(ValueError, match=r"missing environment variable\(s\) \['MASTER_ADDR', 'MASTER_PORT'\]"):
        backend.DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(ValueError, match="outside world size"):
        backend.DistEnv(rank=4, world_size=4)


def test_wire_view_carries_fp8_as_uint8_bytes():
    x = dist_workers.fp8_payload()
    wire = backend.wire_view(x)
    assert wire.dtype == torch.uint8 and wire.data_ptr() == x.data_ptr()
    y = torch.ones(3)
    assert backend.wire_view(y) is y


def test_options_and_failure_messages():
    with pytest.raises(ValueError, match="hang_timeout_s must be longer"):
        WorkerOptions(heartbeat_s=2, hang_timeout_s=1)
    with pytest.raises(ValueError, match="pg_timeout_s must be > 0"):
        WorkerOptions(pg_timeout_s=0)
    assert describe_exit(-9) == "exit code -9 (SIGKILL)" and describe_exit(1) == "exit code 1"
    assert str(WorkerFailure({1: "died", 0: "raised"})) == "rank 0: raised; rank 1: died"


def test_unpicklable_target_fails_before_any_worker_starts():
    with pytest.raises((AttributeError, pickle.PicklingError, TypeError)):
        WorkerGroup(lambda rank, layout: rank, ParallelConfig(1, 2))


# ------------------------------------------------------------------------------------------------- world 2


def test_world2_collectives_through_groups_then_dropped_group_leaves_no_process():
    group = WorkerGroup(dist_workers.collectives, ParallelConfig(1, 2, enable_expert_parallel=True), options=FAST)
    results, pids = group.wait(60), group.pids
    assert [r["pid"] for r in results] == pids
    for rank, res in enumerate(results):
        assert res["backend_file"] == backend.__file__  # spawned workers import this checkout
        assert torch.equal(res["tp_sum"], torch.full((4,), 3.0)) and res["control_max"] == 1
        assert torch.equal(res["a2a"], torch.cat([dist_workers.a2a_block(j, rank) for j in range(2)]))
        half = dist_workers.fp8_payload().float()[8 * rank: 8 * rank + 8]
        assert torch.equal(res["fp8_a2a"], torch.cat([half, half]))
    assert torch.equal(results[1]["fp8_recv"], dist_workers.fp8_payload().float())
    del group
    gc.collect()  # the weakref finalizer closes the workers
    assert _gone_within(pids, 1)


def test_killed_rank_is_reported_and_peers_do_not_hang(tmp_path):
    options, seen = WorkerOptions(pg_timeout_s=5, heartbeat_s=0.2, hang_timeout_s=30, join_timeout_s=3), []
    with WorkerGroup(dist_workers.allreduce_forever, ParallelConfig(1, 2), (str(tmp_path),), options,
                     on_failure=seen.append) as group:
        assert _within(60, lambda: group.check() or all((tmp_path / str(r)).exists() for r in (0, 1)))
        killed = time.monotonic()
        os.kill(group.pids[1], signal.SIGKILL)  # mid all_reduce loop
        with pytest.raises(WorkerFailure, match=r"rank 1: died with exit code -9 \(SIGKILL\)"):
            group.wait(timeout_s=10)
        assert time.monotonic() - killed < 2
        assert _within(2, lambda: seen) and 1 in seen[0].failures  # also pushed by the monitor thread
        # rank 0 was blocked in all_reduce: gloo fails it (peer gone, or pg_timeout_s) and the launcher says so
        assert _within(options.pg_timeout_s + 5, lambda: "exit code 1" in group.failures.get(0, ""))
        assert group.failures[0].startswith("raised") and not _alive(group.pids[0])


def test_hung_rank_is_reported_within_the_hang_timeout():
    options = WorkerOptions(pg_timeout_s=10, heartbeat_s=0.2, hang_timeout_s=1.5, join_timeout_s=2)
    with WorkerGroup(dist_workers.pid, ParallelConfig(1, 2), options=options) as group:
        group.wait(60)
        pids = group.pids
        stopped = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        assert _within(10, lambda: 1 in group.failures)
        assert time.monotonic() - stopped < options.hang_timeout_s + 1.5
        assert group.failures[1].startswith("stopped responding: no heartbeat for")
        assert 0 not in group.failures
        with pytest.raises(WorkerFailure, match="rank 1: stopped responding"):
            group.check()
    assert _gone_within(pids, 1)  # close() SIGKILLs the stopped rank


def test_monitored_barrier_names_the_missing_rank():
    with WorkerGroup(dist_workers.skip_barrier, ParallelConfig(1, 2), (1.0,), FAST) as group:
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="Ranks 1 failed to pass monitoredBarrier") as err:
            group.wait(60)
        assert list(err.value.failures) == [0]
        assert time.monotonic() - start < 30


def test_no_orphans_when_the_owner_exits_or_is_killed():
    """Owner processes leave without close(): atexit closes the workers; after SIGKILL they see the pipe EOF."""
    owners = {mode: subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_workers.py"), mode], env=_env(),
                                     stdout=subprocess.PIPE, text=True) for mode in ("exit", "kill")}
    for mode, proc in owners.items():
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == (-signal.SIGKILL if mode == "kill" else 0), out
        pids = [int(p) for p in out.strip("[]\n").split(",")]
        assert pids and _gone_within(pids, 10), f"{mode}: workers {pids} outlived their owner"


# ------------------------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_world4_dp2_tp2_groups():
    with WorkerGroup(verify_world, ParallelConfig(2, 2, enable_expert_parallel=True), options=FAST) as group:
        results = group.wait(120)
    assert [(r["dp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["tp_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["ep_group"] == [0, 1, 2, 3] for r in results)


@pytest.mark.slow
def test_torchrun_two_nodes_of_two_ranks_on_loopback():
    args = ["deepinfer.distributed.check", "--tensor-parallel-size", "2", "--expert-parallel", "--timeout-s", "60"]
    with dist_workers.torchrun_nodes(2, 2, args, _env()) as nodes:
        outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "OK world=4 dp=2 tp=2" in outs[0]
