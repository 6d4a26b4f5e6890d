"""One rank of a multi-rank engine: its model shard, cache and model runner, driven by the driver's step plans.

A rank never schedules. It connects a ZeroMQ DEALER (identity ``rank{N}``) to the driver's ROUTER, reports its
cache layout, then loops: receive a ReplicaPlan for its DP replica, run it through the ordinary ModelRunner (or
nothing, when its replica is idle), join the step's remaining expert-parallel rounds (``finish_step``), and, on
TP rank 0 of the replica, send the RunnerOutput back. TP peers compute the same logits (the LM head gathers
them) and sample the same tokens (same generators, same RNG draws); only rank 0 reports.

Started either by the engine (``distributed.launcher.WorkerGroup`` runs ``run_rank``) or by torchrun
(``python -m deepinfer.distributed.worker --driver HOST:PORT ...``, the process group from torchrun's
environment). A failure is reported to the driver (``("error", rank, traceback)``) before the rank exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import threading
import traceback
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import zmq
from tqdm.std import tqdm
from zmq.utils.monitor import recv_monitor_message

from deepinfer.bench.machine import peak_rss_bytes
from deepinfer.config import EngineArgs, ModelConfig, model_dtype
from deepinfer.distributed.backend import ParallelGroups, build_groups, init_from_env
from deepinfer.distributed.eplb_runtime import ExpertRebalancer
from deepinfer.distributed.layout import RankLayout, make_layout
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.distributed.overlap import TwoBatchForward
from deepinfer.distributed.plan import MirrorBook, ReplicaPlan
from deepinfer.engine.core import cache_specs, load_model, plan_layout, prepare_model, replay_tokens
from deepinfer.spec import build_proposer
from deepinfer.worker.model_runner import CacheLayout, ModelRunner

logger = logging.getLogger("deepinfer")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs, picklable: the checkpoint, the engine options, where the driver listens."""

    model_path: str
    args: EngineArgs
    driver: str  # tcp://host:port


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once ready; the driver checks every rank agrees."""

    rank: int
    layout: CacheLayout
    replay_tokens: int
    pid: int


@dataclass(frozen=True)
class RankStats:
    """One rank's footprint and traffic, for benchmarks and per-rank metrics."""

    rank: int
    dp_rank: int
    tp_rank: int
    param_bytes: int  # every parameter and buffer this rank holds
    expert_param_bytes: int  # of which routed experts
    peak_rss_bytes: int  # the process's peak resident set
    moe_payload_bytes: int  # bytes expert-parallel collectives delivered to this rank so far
    steps: int
    expert_load: list | None = None  # [MoE layers][experts] tokens this rank routed over the window (EP only)
    expert_placement: list | None = None  # [MoE layers][slots] logical expert of each slot (EP only)
    eplb: dict | None = None  # eplb_runtime.EplbCounters as a dict (EPLB only)
    rows_served: list | None = None  # per MoE layer, (token, k) rows this rank's expert slots computed (EP only)


def run_rank(rank: int, layout: RankLayout, spec: WorkerSpec) -> None:
    """WorkerGroup target (the default process group is up): build this rank and serve until told to stop."""
    # tqdm's default lock is a multiprocessing semaphore, which a rank (leaving through os._exit) would leak
    tqdm.set_lock(threading.RLock())
    groups = build_groups(layout, spec.args.distributed_timeout_s, ep_lanes=2 if spec.args.two_batch_overlap else 1)
    RankWorker(groups, spec).serve()


def rank_device(args: EngineArgs) -> torch.device:
    """CUDA: this rank's local GPU; CPU: the CPU (intra-op threads shared out among the node's ranks)."""
    if args.device.startswith("cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", args.parallel.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")


class RankWorker:
    def __init__(self, groups: ParallelGroups, spec: WorkerSpec):
        args, layout = spec.args, groups.layout
        self.spec, self.groups, self.rank = spec, groups, groups.rank
        self.dp_rank, self.tp_rank = layout.dp_rank(self.rank), layout.tp_rank(self.rank)
        self.device = rank_device(args)
        torch.manual_seed(args.seed)  # TP peers draw the same unseeded samples
        config = ModelConfig.from_hf(spec.model_path)
        dtype = model_dtype(args.dtype, config, self.device.type)
        parallel = ModelParallel.from_groups(groups, config.n_routed_experts or 1, args.moe_comm, args.eplb_window_size)
        progress = args.load_progress and self.rank == 0
        self.model = load_model(spec.model_path, config, dtype, self.device, progress, parallel)
        prepare_model(self.model, args)
        self.parallel = parallel
        self.runner = self._runner(config, args)
        self.overlap = TwoBatchForward(self.model, parallel) if args.two_batch_overlap else None
        if self.overlap is not None:
            self.runner.forward = self.overlap
        self.book = MirrorBook()
        self.steps = 0

    def _runner(self, config: ModelConfig, args: EngineArgs) -> ModelRunner:
        max_model_len = args.max_model_len or config.max_position
        proposer = build_proposer(args.speculative, self.model, self.spec.model_path)
        if args.eplb.active and self.parallel.expert_parallel:  # every MoE layer (MTP's too) is registered now
            self.parallel.rebalancer = ExpertRebalancer(self.parallel, args.eplb)
            self.parallel.rebalancer.start()  # before the KV budget is measured: redundant slots count
        layout = agree_layout(plan_layout(self.model, args, max_model_len, self.device), self.groups.control)
        return ModelRunner(self.model, layout, self.device, args.deterministic, args.seed, proposer,
                           cache_specs(self.model, args, layout.block_size))

    def info(self) -> RankInfo:
        return RankInfo(self.rank, self.runner.layout, replay_tokens(self.model, self.spec.args), os.getpid())

    # --- serving --------------------------------------------------------------------------------
    def serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.spec.driver)
        self.driver_events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()  # the driver's messages, and its connection dropping
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.driver_events, zmq.POLLIN)
        try:
            sock.send(pickle.dumps(("ready", self.rank, self.info())))
            self._loop(sock)
        except BaseException:
            sock.send(pickle.dumps(("error", self.rank, traceback.format_exc())))
            raise
        finally:
            self.driver_events.close()
            sock.close()
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        while True:
            kind, step, plan = pickle.loads(self._next(sock))
            if kind == "stop":
                return
            if kind == "stats":
                sock.send(pickle.dumps(("stats", step, self.rank, self.stats())))
                continue
            if kind != "step":  # a bitmask its step did not read (no constrained row sampled)
                continue
            result = self.execute(plan, _MaskFromDriver(sock, step) if plan.grammar_pending else None)
            self.steps += 1
            if self.tp_rank == 0:
                sock.send(pickle.dumps(("result", step, self.dp_rank, result)))

    def _next(self, sock: zmq.Socket) -> bytes:
        """The driver's next message. The driver's connection dropping ends the rank (a torchrun-started rank
        has no other way to learn that its driver died; a spawned one also watches its parent)."""
        while True:
            ready = dict(self.poller.poll())
            if sock in ready:
                return sock.recv()
            if recv_monitor_message(self.driver_events)["event"] == zmq.EVENT_DISCONNECTED:
                raise ConnectionError(f"rank {self.rank}: the driver at {self.spec.driver} disconnected")

    def stats(self) -> RankStats:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        experts = [p for name, p in self.model.named_parameters() if name.endswith((".experts.w13", ".experts.w2"))]
        moe = self.parallel.moe_payload_bytes
        load = self.parallel.load
        placement = [list(e.placement.slot_experts) for e in self.parallel.experts] if self.parallel.expert_parallel \
            else None
        rebalancer = self.parallel.rebalancer
        return RankStats(self.rank, self.dp_rank, self.tp_rank, _nbytes(tensors), _nbytes(experts),
                         peak_rss_bytes(), moe, self.steps, None if load is None else load.totals().tolist(),
                         placement, None if rebalancer is None else asdict(rebalancer.counters),
                         [e.rows_served for e in self.parallel.experts] if self.parallel.expert_parallel else None)

    def execute(self, plan: ReplicaPlan, pending_mask: Future | None = None):
        """Run this replica's plan (None when idle), then join the step's remaining EP rounds (with two-batch
        overlap each lane drains right after its forward)."""
        out = self.book.decode(plan, pending_mask)
        if self.overlap is not None:
            return self.overlap.idle() if plan.is_idle else self.runner.execute(out)
        result = None if plan.is_idle else self.runner.execute(out)
        self.parallel.finish_step()
        return result


class _MaskFromDriver(Future):
    """Async scheduling: a step's bitmask, sent by the driver right after the step's plan (once the previous
    step's tokens reached the matchers). The sampler's result() call receives it; nothing else can come first."""

    def __init__(self, sock: zmq.Socket, step: int):
        super().__init__()
        self.sock, self.step = sock, step

    def result(self, timeout: float | None = None):
        if not self.done():
            kind, step, mask = pickle.loads(self.sock.recv())
            if (kind, step) != ("mask", self.step):
                raise RuntimeError(f"expected the bitmask of step {self.step}, got {kind!r} for step {step}")
            self.set_result(mask)
        return super().result(timeout)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def agree_layout(layout: CacheLayout, control: dist.ProcessGroup) -> CacheLayout:
    """Every rank's cache layout shrunk to the smallest block and snapshot counts of the world (collective),
    so one scheduler's block ids are valid on every rank."""
    counts = torch.tensor([layout.num_blocks, layout.num_snapshot_slots], dtype=torch.long)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=control)
    blocks, snapshots = counts.tolist()
    return replace(layout, num_blocks=blocks, num_snapshot_slots=snapshots)


# --- torchrun entry ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """`torchrun ... -m deepinfer.distributed.worker --driver HOST:PORT --model PATH [engine options]`."""
    from deepinfer.cli import add_engine_args, engine_kwargs
    from deepinfer.llm import resolve_model

    parser = argparse.ArgumentParser(prog="python -m deepinfer.distributed.worker")
    parser.add_argument("--driver", required=True, metavar="HOST:PORT", help="the engine's --driver-address")
    add_engine_args(parser)
    ns = parser.parse_args(argv)
    args = EngineArgs.from_kwargs(**engine_kwargs(ns))
    path, _ = resolve_model(ns.model)
    env = init_from_env(args.distributed_timeout_s)
    layout = make_layout(args.parallel, env.world_size)
    run_rank(env.rank, layout, WorkerSpec(str(Path(path)), args, f"tcp://{ns.driver}"))
    dist.destroy_process_group()


if __name__ == "__main__":  # run the module under its import name, so what it pickles unpickles in the driver
    from deepinfer.distributed import worker

    worker.main()
