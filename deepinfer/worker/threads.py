"""Intra-op threads per step on CPU. A step of a few tokens is a few hundred microseconds of small kernels: every
parallel region's fork and join (and, under load, waiting for a core the API process or a tokenizer thread holds)
costs more than a second thread saves, so such steps run on one thread and larger steps on all of the engine's.

Policy (`step_threads`) is a pure function; `StepThreads` applies it, calling torch.set_num_threads only when the
count changes. Not used in deterministic mode (a GEMM's rounding may depend on its thread count) or on CUDA.
"""

from __future__ import annotations

import os

import torch

SMALL_STEP_TOKENS = 2  # steps of at most this many tokens run on one thread (DEEPINFER_SMALL_STEP_TOKENS; 0: off)


def step_threads(num_tokens: int, max_threads: int, small_step_tokens: int = SMALL_STEP_TOKENS) -> int:
    """One thread for steps of at most small_step_tokens tokens, max_threads otherwise."""
    return 1 if num_tokens <= small_step_tokens else max(1, max_threads)


class StepThreads:
    def __init__(self, max_threads: int | None = None, small_step_tokens: int | None = None):
        self.max_threads = max_threads or torch.get_num_threads()
        env = os.environ.get("DEEPINFER_SMALL_STEP_TOKENS")
        self.small = small_step_tokens if small_step_tokens is not None else int(env or SMALL_STEP_TOKENS)
        self.current = torch.get_num_threads()

    def apply(self, num_tokens: int) -> None:
        want = step_threads(num_tokens, self.max_threads, self.small)
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
