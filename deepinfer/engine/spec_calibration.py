"""Start-up calibration of the adaptive speculation policy (like a profile run): decode steps with and
without drafting are timed on dummy requests at batch sizes 1, 2, 4, ... before the engine serves, so the
speculation gate predicts from its first real step instead of exploring on live traffic (where exploring
costs the requests it runs on). Nothing of the dummy requests survives: they are aborted (their blocks
freed), the prefix cache is reset, and the speculation counters start from zero."""

from __future__ import annotations

import logging
import random
import statistics
import time

from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

PROMPT_LEN = 64
MEASURED_STEPS = 8  # steady-state steps timed per batch size and mode
MAX_BATCH = 128  # larger batches use the largest measured bucket


def calibration_batches(max_num_seqs: int, blocks_per_request: int, num_blocks: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs (and MAX_BATCH), while the batch fits in half the KV cache."""
    batches, b = [], 1
    while b <= min(max_num_seqs, MAX_BATCH) and 2 * b * blocks_per_request <= num_blocks:
        batches.append(b)
        b *= 2
    return batches


def calibrate_speculation(engine) -> None:
    k = engine.speculative.num_speculative_tokens
    max_tokens = (2 * MEASURED_STEPS + 8) * (k + 1)
    if PROMPT_LEN + max_tokens + k >= min(engine.max_model_len, engine.layout.num_tokens):
        logger.info("speculation calibration skipped: the context is too short; the gate explores instead")
        return
    per_request = -(-(PROMPT_LEN + max_tokens + 2 * k) // engine.layout.block_size)
    batches = calibration_batches(engine.args.max_num_seqs, per_request, engine.layout.num_blocks)
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sched = engine.scheduler
    rng = random.Random(0)
    for n, batch in enumerate([1, *batches]):  # the first round warms up and is discarded
        ids = [f"__calibration-{n}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, _prompt(rng, engine.model_config.vocab_size), params)
        times = _time_modes(engine, ids)
        for rid in ids:
            engine.abort(rid)
        if n == 0:
            sched.step_profile.samples.clear()
        for mode, seconds in times.items():
            if n and seconds:
                sched.gate.times[(sched.gate.bucket(batch), mode)] = statistics.median(seconds)
    sched.gate.frozen = any(drafting for _, drafting in sched.gate.times)
    sched.forced_drafting = None
    sched.spec_stats = SpecDecodeStats()
    sched.num_preemptions = 0
    engine.reset_prefix_cache()
    logger.info("speculation calibrated at batch sizes %s in %.1f s", batches, time.perf_counter() - started)


def _prompt(rng: random.Random, vocab_size: int) -> list[int]:
    """A random 16-token cycle repeated: n-gram lookup drafts on it, and requests differ from each other (as
    live ones do: identical requests would route every token to the same experts and time a cheaper step)."""
    cycle = [rng.randrange(3, vocab_size) for _ in range(16)]
    return (cycle * (PROMPT_LEN // 16 + 1))[:PROMPT_LEN]


def _time_modes(engine, ids: list[str]) -> dict[bool, list[float]]:
    """Seconds of steady-state steps with drafting (every draft verified) and without. Drafting steps also
    go to the step-time profile the verify-length policy reads."""
    sched = engine.scheduler
    reqs = [sched.requests[rid] for rid in ids]
    sched.forced_drafting = True
    for _ in range(64):  # prefill (possibly chunked), drafting as it ends
        if all(r.output_token_ids for r in reqs):
            break
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for mode in (True, False, True, False):  # alternating blocks, so a drift of the machine hits both modes
        sched.forced_drafting = mode
        for _ in range(MEASURED_STEPS // 2 + 1):  # the first step of a block is a switch, not measured
            started = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - started
            out = engine.last_scheduled
            if sched.steady_mode(out) == mode:
                times[mode].append(seconds)
                if mode:
                    sched.step_profile.record(out.num_tokens, seconds)
    return times
