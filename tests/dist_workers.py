"""WorkerGroup targets for test_distributed.py; spawned workers import this module by name (the parent's
sys.path travels with spawn). Run as a script, it is an owner process that leaves without close()."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import deepinfer.distributed.backend as backend
from deepinfer.config import ParallelConfig
from deepinfer.distributed.launcher import WorkerGroup, WorkerOptions, free_port


@contextlib.contextmanager
def torchrun_nodes(nnodes: int, nproc: int, module_args: list[str], env: dict[str, str], capture: bool = True):
    """`nnodes` torchrun agents of `nproc` ranks each on loopback, running `-m module_args...`; every agent's
    session (agent and ranks) is SIGKILLed on the way out if it is still running."""
    port = free_port()
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
         "--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", *module_args],
        env=env, stdout=out, stderr=subprocess.STDOUT if capture else out, text=True, start_new_session=True)
        for i in range(nnodes)]
    try:
        yield nodes
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def a2a_rows(src: int, dst: int) -> int:
    """Uneven all_to_all_single splits, zeros included: (src + 2 dst) % 3 rows go from src to dst."""
    return (src + 2 * dst) % 3


def a2a_block(src: int, dst: int) -> torch.Tensor:
    """The rows src sends to dst, each one naming (src, dst, row)."""
    n = a2a_rows(src, dst)
    return torch.tensor([[src, dst, i] for i in range(n)], dtype=torch.float32).reshape(n, 3)


def fp8_payload() -> torch.Tensor:
    return (torch.arange(16, dtype=torch.float32) / 4 - 2).to(torch.float8_e4m3fn)


def _uneven_all_to_all(rank: int, groups: backend.ParallelGroups) -> torch.Tensor:
    world = groups.layout.world_size
    send = torch.cat([a2a_block(rank, j) for j in range(world)])
    out = torch.empty(sum(a2a_rows(j, rank) for j in range(world)), 3)
    dist.all_to_all_single(out, send, output_split_sizes=[a2a_rows(j, rank) for j in range(world)],
                           input_split_sizes=[a2a_rows(rank, j) for j in range(world)], group=groups.ep)
    return out


def _fp8_all_to_all(groups: backend.ParallelGroups) -> torch.Tensor:
    """Each rank sends half of the fp8 payload to each of the 2 ranks, through uint8 views."""
    out = torch.empty(16, dtype=torch.float8_e4m3fn)
    dist.all_to_all_single(backend.wire_view(out), backend.wire_view(fp8_payload()), group=groups.tp)
    return out.float()


def _fp8_send_recv(rank: int) -> torch.Tensor | None:
    if rank == 0:
        backend.send_tensor(fp8_payload(), dst=1)
        return None
    return backend.recv_tensor(torch.empty(16, dtype=torch.float8_e4m3fn), src=0).float()


def collectives(rank: int, layout) -> dict:
    """World 2, TP 2 with EP: the collectives the engine will build on, through our groups."""
    groups = backend.build_groups(layout, timeout_s=30)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=groups.tp)
    flag = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.control)
    backend.barrier(groups, timeout_s=30)
    return {"tp_sum": t, "control_max": flag.item(), "a2a": _uneven_all_to_all(rank, groups),
            "fp8_a2a": _fp8_all_to_all(groups), "fp8_recv": _fp8_send_recv(rank),
            "backend_file": backend.__file__, "pid": os.getpid()}


def allreduce_forever(rank: int, layout, marker_dir: str) -> None:
    """All-reduce until a peer fails; drops a marker once the first all_reduce went through."""
    t = torch.ones(4096)
    dist.all_reduce(t)
    Path(marker_dir, str(rank)).touch()
    while True:
        dist.all_reduce(t)


def skip_barrier(rank: int, layout, timeout_s: float) -> int:
    """Rank 1 never reaches the control-group barrier; rank 0's monitored barrier must name it."""
    groups = backend.build_groups(layout, timeout_s=30)
    if rank == 1:
        time.sleep(3 * timeout_s)
    else:
        backend.barrier(groups, timeout_s)
    return rank


def pid(rank: int, layout) -> int:
    return os.getpid()


_KEEP = []  # a live reference: only the atexit hook can close this group


def owner(mode: str) -> None:
    """Print the worker pids, then leave without close(): "exit" normally, "kill" by SIGKILL (no atexit)."""
    group = WorkerGroup(pid, ParallelConfig(), options=WorkerOptions(heartbeat_s=0.2, hang_timeout_s=30))
    _KEEP.append(group)
    print(json.dumps(group.wait(60)), flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    owner(sys.argv[1])
