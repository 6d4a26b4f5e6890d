"""worker/threads: one intra-op thread for steps of a few tokens, all of the engine's for larger ones."""

import torch

from deepinfer.worker.threads import StepThreads, step_threads


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
