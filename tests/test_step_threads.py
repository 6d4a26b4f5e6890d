"""worker/threads: one intra-op thread for steps of a few tokens, all of the engine's for larger ones."""

import pytest
import torch

from deepinfer.config import EngineArgs
from deepinfer.engine import engine_proc
from deepinfer.worker.threads import StepThreads, engine_threads, set_engine_threads, step_threads


def test_policy():
    assert [step_threads(n, 4, 2) for n in (1, 2, 3, 64)] == [1, 1, 4, 4]
    assert step_threads(1, 4, 0) == 4  # 0 turns it off
    assert step_threads(100, 0, 2) == 1  # never below one thread


def test_applies_only_changes_and_restores(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = StepThreads(max_threads=2, small_step_tokens=2)
    threads.current = 2
    for n in (1, 1, 16, 16, 2):
        threads.apply(n)
    assert calls == [1, 2, 1]


def test_env_sets_the_small_step_size(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SMALL_STEP_TOKENS", "0")
    assert StepThreads(max_threads=2).small == 0


def test_engine_threads_leave_a_core_to_the_api_process_when_served():
    assert engine_threads(2, served=True) == 1
    assert engine_threads(16, served=True) == 15
    assert engine_threads(1, served=True) == 1  # never below one thread
    assert engine_threads(16) == 16  # offline: every core
    assert engine_threads(16, requested=4, served=True) == 4  # cpu_threads wins


def test_set_engine_threads_touches_only_cpu_engines_that_ask(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    set_engine_threads(torch.device("cpu"))  # offline default: torch's own count stays
    set_engine_threads(torch.device("cpu"), served=True)
    set_engine_threads(torch.device("cpu"), requested=3)
    set_engine_threads(torch.device("cuda"), requested=3, served=True)
    assert calls == [7, 3]


@pytest.mark.parametrize("kwargs, served", [({}, True), ({"deterministic": True}, False),
                                            ({"tensor_parallel_size": 2}, False)])
def test_served_engine_process_sets_its_threads(monkeypatch, kwargs, served):
    """The engine process of `deepinfer serve` applies the served policy before building a one-process engine
    (not in deterministic mode: served and offline outputs must agree; ranks split the cores themselves)."""
    seen = []
    monkeypatch.setattr(engine_proc, "set_engine_threads", lambda device, requested, served: seen.append(served))
    monkeypatch.setattr(engine_proc, "build_engine", lambda path, args: args)
    args = engine_proc.build_core(None, {"cpu_threads": 0, **kwargs})
    assert seen == ([True] if served else []) and args.cpu_threads == 0


def test_cpu_threads_is_validated():
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineArgs(cpu_threads=-1)


def test_cpu_threads_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "3")
    assert EngineArgs().cpu_threads == 3
    monkeypatch.delenv("DEEPINFER_CPU_THREADS")
    assert EngineArgs().cpu_threads == 0


def test_counts_are_every_count_a_compiled_part_may_run_on():
    """Its own step's count, and all of the engine's beside a prompt chunk."""
    assert StepThreads(max_threads=4, small_step_tokens=2).counts(1) == [1, 4]
    assert StepThreads(max_threads=4, small_step_tokens=2).counts(4) == [4]
    assert StepThreads(max_threads=1, small_step_tokens=2).counts(1) == [1]
    assert StepThreads(max_threads=4, small_step_tokens=0).counts(1) == [4]
