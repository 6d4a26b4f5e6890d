"""Intra-op threads on CPU: how many the engine uses, and how many each step uses.

The engine's count (`engine_threads`): every core for the offline API; every core but one for a served engine.
Its API process (and, on one machine, the load generator) parses and streams every token on a core of its own;
an intra-op parallel region whose second thread waits for that core stalls every step. Measured on 2 cores
(benchmarks/peers.py against its `all-cores` variant, docs/performance.md): one engine thread served 1.2-1.8x the
output tokens/s of two at concurrency 16 and 64 on V3 checkpoints, while a step replayed alone was within about 10%
on one thread or two; V4 checkpoints, whose prompt steps still gain from a second thread, served 0.62-1.02x.
torch.compile guards on the thread count: a compiled step called at a count it was not compiled for recompiles
(seconds) while every request waits, so compiled steps are compiled at start-up under every count of
`StepThreads.counts` (compiled_step.CompiledSteps.warm_keys), and no other count is ever set mid-serving.

A step's count (`step_threads`): a step of a few tokens is a few hundred microseconds of small kernels; every
parallel region's fork and join costs more than a second thread saves, so such steps run on one thread and larger
steps on all of the engine's.

Policies are pure functions; `StepThreads` applies the step policy, calling torch.set_num_threads only when the
count changes. Neither changes threads in deterministic mode (a GEMM's rounding may depend on its thread count: a
served and an offline engine must agree) or on CUDA; an explicit `cpu_threads` always applies.
"""

from __future__ import annotations

import os

import torch

SMALL_STEP_TOKENS = 2  # steps of at most this many tokens run on one thread (DEEPINFER_SMALL_STEP_TOKENS; 0: off)


def engine_threads(cores: int, requested: int = 0, served: bool = False) -> int:
    """`requested` when set (> 0); else every core, less one for the API process when served (at least one)."""
    if requested > 0:
        return requested
    return max(1, cores - 1) if served else max(1, cores)


def set_engine_threads(device: torch.device, requested: int = 0, served: bool = False) -> None:
    """Apply engine_threads on a CPU engine; the offline API's default (every core, torch's own) is left alone."""
    if device.type == "cpu" and (requested > 0 or served):
        torch.set_num_threads(engine_threads(os.cpu_count() or 1, requested, served))


def step_threads(num_tokens: int, max_threads: int, small_step_tokens: int = SMALL_STEP_TOKENS) -> int:
    """One thread for steps of at most small_step_tokens tokens, max_threads otherwise."""
    return 1 if num_tokens <= small_step_tokens else max(1, max_threads)


class StepThreads:
    def __init__(self, max_threads: int | None = None, small_step_tokens: int | None = None):
        self.max_threads = max_threads or torch.get_num_threads()
        env = os.environ.get("DEEPINFER_SMALL_STEP_TOKENS")
        self.small = small_step_tokens if small_step_tokens is not None else int(env or SMALL_STEP_TOKENS)
        self.current = torch.get_num_threads()

    def count(self, num_tokens: int) -> int:
        """The thread count of a step of num_tokens tokens."""
        return step_threads(num_tokens, self.max_threads, self.small)

    def counts(self, num_tokens: int) -> list[int]:
        """Every count a compiled part of num_tokens tokens may run on: its own step's, and all of the engine's
        beside a prompt chunk in a mixed step (a compiled step is compiled once per count: see compiled_step)."""
        return sorted({self.count(num_tokens), max(1, self.max_threads)})

    def apply(self, num_tokens: int) -> None:
        self.set(self.count(num_tokens))

    def set(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
