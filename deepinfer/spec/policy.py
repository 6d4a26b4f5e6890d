"""Verify-length policy: how many of each request's draft tokens the target checks this step.

Pure functions over host numbers, tested on the CPU. A request verifying d drafts with predicted
per-position acceptance c_1, c_2, ... (probability that draft i is accepted given drafts < i were)
yields in expectation 1 + sum_{j <= d} prod_{i <= j} c_i tokens. The step costs T(B) seconds for B
batched tokens (a measured profile). `choose_verify_lengths` maximises expected tokens per second
over the whole batch; `fixed_verify_lengths` verifies every draft.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


def fixed_verify_lengths(num_drafts: Sequence[int]) -> list[int]:
    return list(num_drafts)


def expected_tokens(confidence: Sequence[float], d: int) -> float:
    """Expected tokens emitted when verifying the first d drafts (the correction/bonus token included)."""
    total, prod = 1.0, 1.0
    for c in confidence[:d]:
        prod *= c
        total += prod
    return total


def choose_verify_lengths(confidence: Sequence[Sequence[float]], step_time, base_tokens: int) -> list[int]:
    """Verify lengths maximising expected accepted tokens per second.

    confidence[r]: predicted acceptance of request r's drafts by position (its length bounds d_r);
    step_time(B): seconds of a step with B batched tokens; base_tokens: tokens the step has anyway
    (every request's own next token, other requests' prefill). Marginal gains within a request never
    grow (products of probabilities), so adding positions in order of gain is optimal for every total;
    the best total is then a scan.
    """
    gains = []  # (gain of verifying position j of request r, r)
    for r, conf in enumerate(confidence):
        prod = 1.0
        for c in conf:
            prod *= min(max(c, 0.0), 1.0)
            gains.append((prod, r))
    gains.sort(key=lambda g: -g[0])
    base_value = float(len(confidence))
    best_m, best_rate, value = 0, base_value / step_time(base_tokens), base_value
    for m, (gain, _) in enumerate(gains, 1):
        value += gain
        rate = value / step_time(base_tokens + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    lengths = [0] * len(confidence)
    for _, r in gains[:best_m]:
        lengths[r] += 1
    return lengths


class StepTimeProfile:
    """Measured step time by batched tokens: least-squares line over recent steps (time = a + b * tokens).
    Until two different batch sizes were seen it predicts a cost proportional to 1 + tokens / 256."""

    def __init__(self, window: int = 512):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._stale = True

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))
            self._stale = True

    def line(self) -> tuple[float, float] | None:
        """(a, b) with a > 0 and b >= 0, or None without enough spread in the data (refitted after records)."""
        if self._stale:
            self._fit, self._stale = self._least_squares(), False
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self.samples)
        if n < 2:
            return None
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self.samples)
        if sxx == 0:
            return None
        b = max(sum((t - mx) * (s - my) for t, s in self.samples) / sxx, 0.0)
        a = my - b * mx
        return (a, b) if a > 0 else (max(my * 0.05, 1e-6), my * 0.95 / mx)

    def __call__(self, num_tokens: int) -> float:
        fit = self.line()
        if fit is None:
            return 1.0 + num_tokens / 256
        a, b = fit
        return a + b * num_tokens


class SpeculationGate:
    """Whether to draft at all (adaptive policy): while a drafting step's tokens per request, E, outweigh its cost
    relative to a plain decode step, E * T_off(B) >= min_gain * T_on(B) (a 5% margin for timing error).

    T_on (draft + verify every draft) and T_off are step times per batch-size bucket, measured by the engine's
    start-up calibration and then kept (`frozen`: both modes were timed under the same conditions; live steps
    would refresh only the mode in use, and a fresh time over a stale one drifts as contexts grow), or without a
    calibration, moving averages of live steps; T_on is lowered by the verify cost of the drafts the verify-
    length policy leaves unverified (measured; per token, the slope of T_off over B). E is measured on live
    drafting steps (tokens emitted per request, whatever the verify-length policy chose), per bucket (the
    verify-length policy trims more at larger batches) with the other buckets' data as the prior, and the
    decision uses an upper confidence bound, mean + (k / 2) / sqrt(n + 1) over n request-steps: drafting runs until
    the data show it cannot pay, a loaded engine where it cannot pay stops after a step or two, and while
    drafting is off the counts decay (half-life `half_life` steps), so drafting is eventually re-tried when the
    traffic may have changed."""

    def __init__(self, k: int = 1, alpha: float = 0.25, half_life: int = 1024, min_gain: float = 1.05):
        self.k, self.alpha, self.decay, self.min_gain = k, alpha, 0.5 ** (1.0 / half_life), min_gain
        self.times: dict[tuple[int, bool], float] = {}  # (bucket, drafting) -> seconds per decode step
        self.frozen = False
        self.tokens: dict[int, list[float]] = {}  # bucket -> [tokens emitted, request-steps] while drafting

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()

    def record(self, num_requests: int, drafting: bool, seconds: float) -> None:
        """A steady-state decode step's wall time (exponential moving average per bucket and mode)."""
        if self.frozen:
            return
        key = (self.bucket(num_requests), drafting)
        old = self.times.get(key)
        self.times[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe(self, num_requests: int, emitted: int, verified: int) -> None:
        """A steady-state drafting step emitted `emitted` tokens and verified `verified` drafts over
        `num_requests` requests."""
        counts = self.tokens.setdefault(self.bucket(num_requests), [0.0, 0.0, 0.0])
        counts[0] += emitted
        counts[1] += num_requests
        counts[2] += verified

    def optimistic_tokens(self, num_requests: int) -> float:
        """Upper confidence bound of tokens per request and drafting step, one standard deviation (at most half
        the range, k / 2) over sqrt(n + 1) above the mean; k + 1 before any data."""
        emitted, n, _ = self._counts(num_requests)
        mean = emitted / n if n else self.k + 1.0
        return min(mean + 0.5 * self.k / math.sqrt(n + 1), self.k + 1.0)  # std <= half the range, k

    def unverified_drafts(self, num_requests: int) -> float:
        """Drafts per request the verify-length policy leaves unverified (0 before any data)."""
        _, n, verified = self._counts(num_requests)
        return max(self.k - verified / n, 0.0) if n else 0.0

    def _counts(self, num_requests: int) -> list[float]:
        """[emitted, request-steps, verified] of the bucket, else of all buckets (the prior)."""
        counts = self.tokens.get(self.bucket(num_requests))
        if counts and counts[1] > 0:
            return counts
        return [sum(c[i] for c in self.tokens.values()) for i in range(3)]

    def predicted_gain(self, num_requests: int, expected: float, saved: float = 0.0) -> float | None:
        """Predicted decode rate with drafting over without, from the nearest bucket timed in both modes;
        `saved`: seconds a drafting step saves against T_on by verifying fewer drafts than all."""
        b = self.bucket(num_requests)
        timed = [m for m in {m for m, _ in self.times} if (m, True) in self.times and (m, False) in self.times]
        if not timed:
            return None
        m = min(timed, key=lambda m: (abs(m - b), m))
        on = self.times[(m, True)]
        return expected * self.times[(m, False)] / max(on - saved, on / 2)

    def token_seconds(self) -> float:
        """Cost of one more batched token: the least-squares slope of the plain steps' times over the batch
        sizes timed (bucket b is timed at batch 2^(b-1)); 0 with fewer than two. Not the drafting steps'
        slope, which also carries the drafting cost per request (an MTP layer), unaffected by verification."""
        points = [(2 ** (b - 1), t) for (b, drafting), t in self.times.items() if not drafting]
        if len(points) < 2:
            return 0.0
        mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
        sxx = sum((x - mx) ** 2 for x, _ in points)
        return max(sum((x - mx) * (y - my) for x, y in points) / sxx, 0.0)

    def choose(self, num_requests: int) -> bool:
        saved = self.token_seconds() * num_requests * self.unverified_drafts(num_requests)
        gain = self.predicted_gain(num_requests, self.optimistic_tokens(num_requests), saved)
        if gain is None:  # nothing timed (no calibration): drafting first, then plain decoding
            drafting = (self.bucket(num_requests), True) not in self.times
        else:
            drafting = gain >= self.min_gain
        if not drafting:
            for counts in self.tokens.values():
                counts[0] *= self.decay
                counts[1] *= self.decay
        return drafting
