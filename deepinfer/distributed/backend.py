"""Process groups over torch.distributed: backend choice, init, the TP/DP/EP/control groups, fp8 on the wire.

Backends: gloo on CPU; "cpu:gloo,cuda:nccl" when CUDA and NCCL are both there (CPU tensors then go over gloo,
CUDA tensors over NCCL, in the same group). The control group is always gloo, for small CPU messages
(token counts, idle flags, barriers) even when the data groups are NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.distributed.layout import RankLayout, Ranks

# gloo rejects fp8 ("Invalid scalar type"); these travel as uint8 views of the same bytes.
FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def choose_backend() -> str:
    """The backend string for this machine, decided at run time (the CPU build has no NCCL)."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the world and where rank 0's store listens."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_rank: int = 0

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv:
        """From the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
        env = os.environ if environ is None else environ
        missing = [k for k in _ENV_KEYS if k not in env]
        if missing:
            raise ValueError(f"missing environment variable(s) {missing}; launch with torchrun or set them")
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
                   master_port=int(env["MASTER_PORT"]), local_rank=int(env.get("LOCAL_RANK", "0")))

    def to_environ(self) -> dict[str, str]:
        """The torchrun variables for this rank; from_env(to_environ()) == self."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def init_process_group(env: DistEnv, timeout_s: float = 600.0, backend: str | None = None) -> str:
    """Join the world described by `env`; every collective (and the store) fails after `timeout_s` instead of
    hanging. Under torchrun the tcp:// rendezvous reuses the agent's store. Returns the backend string."""
    backend = backend or choose_backend()
    if "nccl" in backend:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    return backend


def init_from_env(timeout_s: float = 600.0, backend: str | None = None) -> DistEnv:
    """init_process_group from the torchrun variables; the launcher's workers take this same path."""
    env = DistEnv.from_env()
    init_process_group(env, timeout_s, backend)
    return env


def data_device() -> torch.device:
    """Where data-group tensors live: this rank's GPU when NCCL is in use, else the CPU."""
    if "nccl" in choose_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups. `ep` is None without expert parallelism; `control` is a gloo group over the world."""

    rank: int
    layout: RankLayout
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup | None
    control: dist.ProcessGroup
    ep_lanes: tuple[dist.ProcessGroup, ...] = ()  # more EP groups, one per extra overlap lane (two-batch overlap)


def _new_groups(groups: tuple[Ranks, ...], rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """Create every group in `groups` (collective: all ranks, same order) and return the one holding `rank`."""
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks), timeout=timeout)
        mine = group if rank in ranks else mine
    return mine


def build_groups(layout: RankLayout, timeout_s: float = 600.0, ep_lanes: int = 1) -> ParallelGroups:
    """The TP, DP, EP and control groups of this rank.

    Invariant: dist.new_group is collective over the whole world, so every rank creates every group, including
    the ones it is not in, in one fixed order: all TP groups, all DP groups, the EP group, the control group,
    then `ep_lanes - 1` more EP groups (concurrent collectives need a group each).
    All ranks must call build_groups together, with the same layout."""
    rank, timeout = dist.get_rank(), timedelta(seconds=timeout_s)
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"process group has {dist.get_world_size()} ranks, layout has {layout.world_size}")
    tp = _new_groups(layout.tp_groups, rank, timeout)
    dp = _new_groups(layout.dp_groups, rank, timeout)
    ep = None if layout.ep_group is None else _new_groups((layout.ep_group,), rank, timeout)
    control = dist.new_group(list(range(layout.world_size)), timeout=timeout, backend="gloo")
    lanes = () if ep is None else tuple(_new_groups((layout.ep_group,), rank, timeout) for _ in range(ep_lanes - 1))
    return ParallelGroups(rank, layout, tp, dp, ep, control, lanes)


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """A view that every backend accepts: fp8 as uint8 over the same bytes (writes land in `tensor`)."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def send_tensor(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """dist.send that also carries fp8; `dst` is a global rank."""
    dist.send(wire_view(tensor.contiguous()), dst, group=group)


def recv_tensor(out: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """dist.recv into `out` (contiguous, any dtype including fp8); `src` is a global rank. Returns `out`."""
    dist.recv(wire_view(out), src, group=group)
    return out


def barrier(groups: ParallelGroups, timeout_s: float) -> None:
    """A barrier over the control group that names the missing rank(s) after `timeout_s` instead of hanging:
    RuntimeError "Rank r failed to pass monitoredBarrier in ... ms"."""
    dist.monitored_barrier(group=groups.control, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
