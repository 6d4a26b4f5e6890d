"""Verify-length policy: how many of each request's draft tokens the target checks this step.

Pure functions over host numbers, tested on the CPU. A request verifying d drafts with predicted
per-position acceptance c_1, c_2, ... (probability that draft i is accepted given drafts < i were)
yields in expectation 1 + sum_{j <= d} prod_{i <= j} c_i tokens. The step costs T(B) seconds for B
batched tokens (a measured profile). `choose_verify_lengths` maximises expected tokens per second
over the whole batch; `fixed_verify_lengths` verifies every draft.
"""

from __future__ import annotations

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

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """(a, b) with a > 0 and b >= 0, or None without enough spread in the data."""
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
