"""Engines over several ranks: `build_engine` picks the shape, `DPEngineCore` steps data-parallel replicas.

- world 1: the single-process EngineCore.
- data_parallel_size 1, world T: one EngineCore whose runner is the T tensor-parallel ranks.
- data_parallel_size D > 1: D EngineCores (each its own scheduler, KV manager and prefix cache: a DP replica
  owns its requests) stepped together, because with expert parallelism every MoE layer is a collective over
  all ranks. A replica with nothing to run still steps (its ranks join the others' expert rounds).

New requests go to the least loaded replica (``pick_replica``: a pure policy); all n samples of a request stay
on one replica (they share its prompt's cache).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from deepinfer.config import EngineArgs
from deepinfer.distributed.executor import Executor, ReplicaRunner
from deepinfer.engine.core import EngineCore, effective_args
from deepinfer.engine.outputs import RunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")


def build_engine(model: str | Path, args: EngineArgs | None = None):
    """The engine for args' parallel layout (see the module docstring)."""
    args = effective_args(args)
    if args.parallel.world_size == 1:
        return EngineCore(model, args)
    if args.speculative is not None and args.speculative.verify_policy == "adaptive":
        raise ValueError("the adaptive speculative verify policy is not supported on several ranks yet; "
                         "use verify_policy 'fixed'")
    executor = Executor(model, args)
    try:
        if args.parallel.data_parallel_size == 1:
            return _replica(model, args, executor, 0)
        return DPEngineCore(model, args, executor)
    except BaseException:
        executor.close()
        raise


def _replica(model: str | Path, args: EngineArgs, executor: Executor, d: int) -> EngineCore:
    runner = ReplicaRunner(executor, d)
    core = EngineCore(model, args, runner=runner)
    runner.scheduler = core.scheduler  # not the core: no reference cycle, so dropping the engine stops the ranks
    return core


def pick_replica(loads: list[tuple[int, int]]) -> int:
    """The replica for a new request: fewest unfinished requests, then fewest tokens still to compute, then the
    lowest index. loads[d] = (requests, tokens) of replica d."""
    return min(range(len(loads)), key=lambda d: (loads[d], d))


def replica_load(core: EngineCore) -> tuple[int, int]:
    requests = core.scheduler.requests.values()
    return len(requests), sum(r.num_tokens - r.num_computed_tokens for r in requests)


class DPEngineCore:
    """EngineCore's interface over data_parallel_size replicas."""

    def __init__(self, model: str | Path, args: EngineArgs, executor: Executor):
        self._executor = executor
        self.replicas = [_replica(model, args, executor, d) for d in range(args.parallel.data_parallel_size)]
        first = self.replicas[0]
        self.args, self.model_config, self.max_model_len = first.args, first.model_config, first.max_model_len
        self.layout = first.layout  # per replica: every replica has the same cache
        self.owner: dict[str, int] = {}  # request and sample ids -> replica
        self.last_result, self.last_scheduled = RunnerOutput(), SchedulerOutput()

    @property
    def executor(self) -> Executor:
        return self._executor

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, kv_transfer: dict | None = None,
                    images: list | None = None) -> list[Request]:
        self.validate_images(request_id, prompt_token_ids, tuple(images or ()), kv_transfer)  # images: world 1 only
        d = pick_replica([replica_load(c) for c in self.replicas])
        requests = self.replicas[d].add_request(request_id, prompt_token_ids, params, priority, cache_salt,
                                                kv_transfer)
        for req in requests:
            self.owner[req.request_id] = d
        return requests

    def validate_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        return self.replicas[0].validate_request(request_id, prompt, params)

    def validate_images(self, request_id: str, prompt: list[int], images: tuple, kv_transfer: dict | None) -> None:
        self.replicas[0].validate_images(request_id, prompt, images, kv_transfer)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        d = self.owner.pop(request_id, None)
        return None if d is None else self.replicas[d].abort(request_id, status)

    def reset_prefix_cache(self) -> None:
        for core in self.replicas:
            core.reset_prefix_cache()

    @property
    def has_unfinished(self) -> bool:
        return any(core.has_unfinished for core in self.replicas)

    # --- stepping ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        touched = self._step_async() if self.args.async_scheduling else self._step_sync()
        for req in touched:
            if req.is_finished:
                self.owner.pop(req.request_id, None)
        return touched

    def _step_async(self) -> list[Request]:
        """One round: every replica submits its next step and folds in its previous one (EngineCore's async
        step, its plan sent within this round); replicas with nothing to submit get an empty plan."""
        self._executor.begin_round()
        touched = [req for core in self.replicas for req in core.step()]
        self._executor.end_round()
        self.last_scheduled = merge_scheduled([core.last_scheduled for core in self.replicas])
        self.last_result = merge_results([core.last_result for core in self.replicas])
        return touched

    def _step_sync(self) -> list[Request]:
        started = time.perf_counter()
        halves = [core.begin_step() for core in self.replicas]
        touched = [req for failed, _ in halves for req in failed]
        steps = [None if out.is_empty else (out, set(core.scheduler.requests))
                 for core, (_, out) in zip(self.replicas, halves)]
        results = self._executor.execute(steps) if any(steps) else [None] * len(steps)
        for core, (_, out), result in zip(self.replicas, halves, results):
            touched += core.end_step(out, result, started) if result is not None else []
        self._record(halves, results)
        return touched

    def _record(self, halves, results) -> None:
        self.last_scheduled = merge_scheduled([out for _, out in halves])
        self.last_result = merge_results([r for r in results if r is not None])

    def shutdown(self) -> None:
        for core in self.replicas:  # every replica's step in flight first, then the ranks
            core.settle()
        for core in self.replicas:
            core.shutdown()


def merge_scheduled(outs: list[SchedulerOutput]) -> SchedulerOutput:
    """The replicas' scheduled requests as one output (for failure reporting and stats)."""
    merged = SchedulerOutput()
    for out in outs:
        merged.scheduled += out.scheduled
        merged.forks += out.forks
        merged.fork_children += out.fork_children
    return merged


def merge_results(results: list[RunnerOutput]) -> RunnerOutput:
    """Request ids are unique across replicas, so the per-request dicts union without clashes."""
    merged = RunnerOutput()
    for result in results:
        for name in RunnerOutput.__dataclass_fields__:
            getattr(merged, name).update(getattr(result, name))
    return merged
