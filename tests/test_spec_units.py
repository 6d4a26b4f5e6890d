"""Speculative decoding pieces without a model: verification (exact distributions), the verify-length
policy, n-gram lookup, and the scheduler's handling of drafts (budget, caps, rollback, block trimming,
stop tokens inside accepted drafts, rejection listeners)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deepinfer.config import SchedulerConfig, SpeculativeConfig
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import RunnerOutput
from deepinfer.engine.scheduler import Scheduler
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.ngram import lookup
from deepinfer.spec.policy import (
    SpeculationGate,
    StepTimeProfile,
    choose_verify_lengths,
    expected_tokens,
    fixed_verify_lengths,
)
from deepinfer.spec.stats import SpecDecodeStats
from deepinfer.worker.rejection import verify_greedy, verify_random


# --- verification --------------------------------------------------------------------------------
def test_greedy_verification_accepts_the_matching_prefix_then_corrects():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [2, 5, 1]).tokens == [2, 5, 1, 3]  # all accepted + bonus
    v = verify_greedy(logits, [2, 4, 1])
    assert v.accepted == 1 and v.tokens == [2, 5]
    assert verify_greedy(logits, [0, 5, 1]).tokens == [2]


def _exact_two_token_law(p: torch.Tensor) -> dict[tuple[int, int], float]:
    """Plain sampling of two tokens where position j draws from p[j] (the target's rows do not depend on
    the drafted prefix here, as in a verification step whose target rows are fixed)."""
    v = p.shape[1]
    return {(a, b): float(p[0, a] * p[1, b]) for a in range(v) for b in range(v)}


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_reproduces_the_target_law(with_q):
    """Drafts ~ q (or a fixed token), verified by rejection sampling: the first two emitted tokens follow
    p exactly. 8,000 draws, chi-square goodness of fit against the exact law (p > 0.001), and the same
    test rejects a verifier that skips the residual (samples p instead of max(p - q, 0) on reject)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(2, 5, generator=g) * 1.5, -1).double()
    law = _exact_two_token_law(p)
    gen = torch.Generator().manual_seed(1)
    good, lossy = {}, {}
    for _ in range(8_000):
        drafts = (torch.multinomial(q, 1, generator=gen).flatten().tolist() if with_q else [3, 1])
        v = verify_random(p, drafts, gen, q if with_q else None)
        key = tuple(v.tokens[:2]) if len(v.tokens) >= 2 else None
        if key is not None:  # a first-position reject emits one token; count its continuation below
            good[key] = good.get(key, 0) + 1
        else:
            second = int(torch.multinomial(p[1], 1, generator=gen))
            good[(v.tokens[0], second)] = good.get((v.tokens[0], second), 0) + 1
        bad = _lossy(p, drafts, gen, q if with_q else None)
        lossy[bad] = lossy.get(bad, 0) + 1
    assert _gof_p(good, law) > 1e-3
    assert _gof_p(lossy, law) < 1e-3


def _lossy(p, drafts, gen, q) -> tuple[int, int]:
    """Like verify_random but resamples from p on reject (the classic bug)."""
    out = []
    for j, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[j, x])
        if float(torch.rand(1, generator=gen)) * qx < float(p[j, x]):
            out.append(x)
        else:
            out.append(int(torch.multinomial(p[j], 1, generator=gen)))
            break
    while len(out) < 2:
        out.append(int(torch.multinomial(p[len(out)], 1, generator=gen)))
    return tuple(out[:2])


def _gof_p(counts: dict, law: dict) -> float:
    n = sum(counts.values())
    stat, cells = 0.0, 0
    for key, prob in law.items():
        expected = n * prob
        if expected < 5:
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_seeded_verification_is_reproducible():
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1)
    runs = [verify_random(p, [1, 2, 3], torch.Generator().manual_seed(9)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# --- policy --------------------------------------------------------------------------------------
def test_expected_tokens_counts_the_bonus():
    assert expected_tokens([1.0, 1.0], 2) == 3.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.5, 0.5], 0) == 1.0


def _brute_force(conf, step_time, base):
    best, best_rate = None, -1.0
    for lengths in itertools.product(*[range(len(c) + 1) for c in conf]):
        value = sum(expected_tokens(c, d) for c, d in zip(conf, lengths))
        rate = value / step_time(base + sum(lengths))
        if rate > best_rate + 1e-12:
            best, best_rate = list(lengths), rate
    return best, best_rate


@pytest.mark.parametrize("seed", range(6))
def test_verify_lengths_maximise_expected_tokens_per_second(seed):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(4, 3, generator=g).tolist()
    step_time = lambda b: 1.0 + 0.15 * b  # noqa: E731
    lengths = choose_verify_lengths(conf, step_time, 4)
    _, best_rate = _brute_force(conf, step_time, 4)
    rate = sum(expected_tokens(c, d) for c, d in zip(conf, lengths)) / step_time(4 + sum(lengths))
    assert rate == pytest.approx(best_rate)


def test_policy_verifies_everything_when_tokens_are_free_and_nothing_when_they_are_dear():
    conf = [[0.9, 0.8, 0.7], [0.3, 0.2, 0.1]]
    assert choose_verify_lengths(conf, lambda b: 1.0, 2) == [3, 3]
    assert choose_verify_lengths(conf, lambda b: float(b), 2) == [0, 0]  # compute-bound: each token costs
    flat_then_steep = lambda b: 1.0 if b <= 4 else 1.0 + (b - 4)  # noqa: E731
    assert choose_verify_lengths(conf, flat_then_steep, 2) == [2, 0]  # best two positions fit in the flat part
    assert fixed_verify_lengths([3, 1]) == [3, 1]


def test_step_time_profile_fits_measured_steps():
    prof = StepTimeProfile()
    assert prof(10) == pytest.approx(1 + 10 / 256)  # no data: a generic prior
    for tokens in (1, 8, 32, 64):
        prof.record(tokens, 0.01 + 0.001 * tokens)
    a, b = prof.line()
    assert a == pytest.approx(0.01) and b == pytest.approx(0.001)
    assert prof(100) == pytest.approx(0.11)


def test_stats_count_by_position():
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(2, 0)
    s.observe(0, 0)  # no drafts: not a verification round
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.accepted_per_pos == [1, 1, 0] and s.drafted_per_pos == [2, 2, 1]
    assert s.mean_accepted_length == 2.0
    assert all(0 < r < 1 for r in s.acceptance_by_position())


# --- n-gram lookup --------------------------------------------------------------------------------
def test_ngram_lookup_prefers_the_longest_most_recent_match():
    hist = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(hist, 2, 3, 1) == [7, 8]  # "2 3" last seen before "7 8" (3-gram "5 2 3" never occurred)
    assert lookup([4, 5, 6], 3, 3, 1) == []
    assert lookup([1, 2, 1], 5, 2, 1) == [2, 1]  # the continuation runs into the suffix itself


# --- scheduler -----------------------------------------------------------------------------------
EOS = 1


def _sched(k: int = 3, num_blocks: int = 32, budget: int = 64, policy: str = "fixed") -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, 8)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k, verify_policy=policy)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, 4096, speculative=spec)


def _request(rid: str, prompt_len: int = 6, max_tokens: int = 20, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(rid, list(range(10, 10 + prompt_len)), sp, max_tokens, eos_token_ids=(EOS,))


def _step(sched: Scheduler, tokens: dict[str, list[int]], drafts: dict[str, list[int]]):
    """One step whose verification emits `tokens[rid]` (accepted drafts + one) and proposes `drafts`."""
    out = sched.schedule()
    result = RunnerOutput()
    for s in out.scheduled:
        rid = s.request.request_id
        if s.samples:
            emitted = tokens.get(rid, [7])
            result.accepted_drafts[rid], result.sampled[rid] = emitted[:-1], emitted[-1]
        if rid in drafts:
            result.drafts[rid] = drafts[rid]
    sched.update(out, result)
    return out


def test_drafts_are_extra_tokens_and_rejected_ones_roll_back():
    sched, req = _sched(), _request("a")
    sched.add(req)
    out = _step(sched, {"a": [50]}, {"a": [60, 61, 62]})  # prefill samples 50, proposes 3 drafts
    assert out.scheduled[0].num_new_tokens == 6 and req.num_computed_tokens == 6
    rejected = []
    sched.rejection_listeners.append(lambda r, toks: rejected.append(list(toks)))
    out = _step(sched, {"a": [60, 70]}, {"a": [80, 81, 82]})  # verify 3: accept 1, correct to 70
    s = out.scheduled[0]
    assert s.num_new_tokens == 4 and s.draft_token_ids == [60, 61, 62]
    assert req.output_token_ids == [50, 60, 70] and req.num_computed_tokens == 8 and rejected == [[61, 62]]
    assert len(sched.kv.blocks["a"]) == sched.kv.blocks_needed(8 + 1 + 3)  # rejected tail released
    assert sched.spec_stats.num_accepted_tokens == 1 and sched.spec_stats.num_draft_tokens == 3


def test_drafts_fit_the_budget_and_the_output_cap():
    sched, req = _sched(budget=3), _request("a", prompt_len=2, max_tokens=4)
    sched.add(req)
    _step(sched, {"a": [50]}, {"a": [60, 61, 62]})
    out = _step(sched, {"a": [60, 61]}, {"a": [80, 81, 82]})
    assert out.scheduled[0].draft_token_ids == [60, 61]  # budget 3 = the real token + 2 drafts
    out = _step(sched, {"a": [80]}, {})
    assert out.scheduled[0].draft_token_ids == []  # 3 of 4 outputs done: a draft could never be used
    assert req.output_token_ids == [50, 60, 61, 80] and req.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == 32


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched, req = _sched(), _request("a")
    sched.add(req)
    _step(sched, {"a": [50]}, {"a": [60, EOS, 62]})
    _step(sched, {"a": [60, EOS, 62, 63]}, {})
    assert req.output_token_ids == [50, 60, EOS] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.num_free_blocks == 32 and not sched.kv.blocks


def test_logprob_requests_and_prefill_chunks_carry_no_drafts():
    sched = _sched(budget=8)
    a, b = _request("a", logprobs=1), _request("b", prompt_len=20)
    sched.add(a)
    _step(sched, {"a": [50]}, {"a": [60, 61]})
    sched.add(b)
    out = _step(sched, {"a": [60]}, {})
    assert all(s.num_drafts == 0 for s in out.scheduled)


def test_adaptive_policy_drops_drafts_when_steps_are_compute_bound():
    sched = _sched(policy="adaptive")
    for i in range(40):  # a profile where every batched token costs as much as the step itself
        sched.step_profile.record(1 + i, 0.0001 + 0.001 * (1 + i))
    req = _request("a")
    sched.add(req)
    _step(sched, {"a": [50]}, {"a": [60, 61, 62]})
    req.spec_confidence = [0.4, 0.3, 0.2]
    out = _step(sched, {"a": [60]}, {})
    assert out.scheduled[0].num_drafts == 0
    assert math.isclose(sched.step_profile(10), 0.0101, rel_tol=1e-6)


def test_gate_times_both_modes_when_there_is_no_calibration():
    gate = SpeculationGate(k=3)
    assert gate.predicted_gain(8, 3.0) is None
    assert gate.choose(8) is True  # nothing timed: drafting first
    gate.record(8, True, 0.030)
    assert gate.choose(8) is False  # then plain decoding
    gate.record(8, False, 0.010)
    assert gate.predicted_gain(8, 3.0) == pytest.approx(1.0)
    gate.record(8, False, 0.020)  # a moving average of live steps
    assert gate.times[(4, False)] == pytest.approx(0.0125)
    gate.frozen = True  # calibrated: live steps no longer change the times
    gate.record(8, False, 0.030)
    assert gate.times[(4, False)] == pytest.approx(0.0125)


def test_gate_drafts_until_the_data_show_it_cannot_pay():
    gate = SpeculationGate(k=3)
    # drafting costs 2.83x a plain step at batch 32; it must gain min_gain = 1.05: E >= 2.975
    gate.times = {(6, True): 0.085, (6, False): 0.030, (1, True): 0.015, (1, False): 0.010}
    assert gate.optimistic_tokens(32) == 4.0 and gate.choose(32)  # no data: up to 4 tokens, 1.41x: try
    gate.observe(32, 32 * 2.75, 32 * 3)  # 2.75 tokens per request: the bound 2.75 + 1.5 / sqrt(33) = 3.01
    assert gate.optimistic_tokens(32) == pytest.approx(2.75 + 1.5 / 33 ** 0.5) and gate.choose(32)
    gate.observe(32, 32 * 2.75, 32 * 3)
    assert not gate.choose(32)  # 2.75 + 1.5 / sqrt(65) = 2.94: stops after two steps
    assert gate.choose(1)  # batch 1 has no data of its own: batch 32's as the prior, 2.94 * 0.67 = 1.96
    # while off, the counts decay (half-life 1024 steps), so drafting is re-tried once the bound is back
    # above 2.975: n < 43.4, about 1024 * log2(64 / 43.4) = 574 steps later
    modes = [gate.choose(32) for _ in range(1000)]
    assert 560 < modes.index(True) < 585 and gate.tokens[6][1] < 43.5


def test_gate_data_are_per_batch_bucket():
    gate = SpeculationGate(k=3)
    gate.times = {(b, m): (0.05 if m else 0.02) for b in (1, 6) for m in (True, False)}  # 2.5x slower drafting
    for _ in range(100):
        gate.observe(1, 4, 3)  # batch 1: every draft accepted
        gate.observe(32, 64, 96)  # batch 32: 2 tokens per request
    assert gate.choose(1) and not gate.choose(32)


def test_adaptive_scheduler_stops_drafting_when_plain_decoding_is_faster():
    sched = _sched(policy="adaptive")
    req = _request("a", max_tokens=60)
    sched.add(req)
    _step(sched, {"a": [50]}, {"a": [60, 61, 62]})
    modes = []
    for _ in range(12):
        out = sched.schedule()
        result = RunnerOutput(sampled={"a": 7})
        if out.propose_drafts:
            result.drafts["a"] = [70, 71, 72]
        sched.update(out, result)
        sched.record_step(out, result, 0.010 if out.propose_drafts else 0.002)  # drafting: 5x slower steps
        modes.append(out.propose_drafts)
    # drafting is measured on a step that verifies drafts, plain decoding on one after the switch settles
    assert modes[:4] == [True, False, False, False] and not any(modes[4:12])
    assert all(s.num_drafts == 0 for s in out.scheduled)


def test_gate_credits_drafts_the_verify_length_policy_leaves_unverified():
    gate = SpeculationGate(k=3)
    gate.times = {(6, True): 0.065, (6, False): 0.025}  # T_on: every one of 3 drafts verified
    gate.observe(32, 64, 32)  # 2 tokens per request from 1 verified draft each: 2 of 3 left unverified
    assert gate.unverified_drafts(32) == 2.0 and gate.token_seconds() == 0.0
    assert not gate.choose(32)  # against the full T_on: (2 + 1.5 / sqrt(33)) * 25 / 65 = 0.87
    gate.times[(1, False)] = 0.0188  # plain steps: 6.2 ms more for 31 more requests, 0.2 ms per token
    assert gate.token_seconds() == pytest.approx(0.0002)
    # 64 fewer batched tokens at 0.2 ms each: T_on 52.2 ms, 2.261 * 25 / 52.2 = 1.08
    assert gate.predicted_gain(32, gate.optimistic_tokens(32), 0.0128) == pytest.approx(2.2611 * 25 / 52.2, rel=1e-3)
    assert gate.choose(32)


def test_gate_judges_a_step_by_its_batch_after_admission():
    """Drafting pays alone but not among 8: 8 waiting requests are prefilled without drafting."""
    sched = _sched(policy="adaptive")
    sched.gate.times = {(1, True): 0.015, (1, False): 0.010, (4, True): 0.080, (4, False): 0.020}
    sched.gate.frozen = True
    for i in range(8):
        sched.add(_request(f"r{i}", max_tokens=4))
    out = sched.schedule()
    assert len(out.scheduled) == 8 and not out.propose_drafts
    alone = _sched(policy="adaptive")
    alone.gate.times = sched.gate.times
    alone.add(_request("a", max_tokens=4))
    assert alone.schedule().propose_drafts
