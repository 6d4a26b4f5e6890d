"""Serving-benchmark metrics with the same definitions as vLLM's ``bench serve``.

Definitions (all per-request times are seconds in ``RequestRecord``; reported stats are milliseconds):

* TTFT: send -> first output token.
* TPOT: ``(latency - ttft) / (output_tokens - 1)``; TTFT is excluded, and a request with <= 1 output token
  has no TPOT (it is left out of the TPOT statistics but still counts in throughput).
* ITL: every gap between consecutive output chunks, pooled over all requests (not averaged per request).
* E2EL: send -> last output token (``latency``).
* Only successful requests enter latency stats, token totals and throughput; failed ones are only counted.
* Goodput: successful requests per second meeting EVERY given SLO (``value <= slo``, keys ttft/tpot/e2el in ms).
  As in vLLM, a request without a TPOT counts as TPOT 0, so it meets any TPOT SLO vacuously.
* Peak concurrency: max overlap of the half-open intervals ``[start, start + latency)`` of all records
  (failed ones too: they held a server slot until they failed).
* Speculative decoding (when the server exports vLLM-named counters): mean accepted length =
  ``1 + accepted / drafts`` (tokens a request gains per verify step, bonus token included), acceptance rate =
  ``accepted / draft tokens``, per-position acceptance = ``accepted at position i / drafts``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

MS_PER_S = 1000.0
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """Client-side timing of one benchmark request (times in seconds).

    Invariant: ``success`` implies ``ttft is not None`` and ``latency >= ttft``.
    """

    start: float
    ttft: float | None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = True
    error: str | None = None


def tpot(record: RequestRecord) -> float | None:
    """Mean time per output token after the first one; None when there is no second token."""
    if record.output_tokens <= 1 or record.ttft is None:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Distribution summary in milliseconds; all fields are 0.0 when ``count == 0`` (as vLLM reports)."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    def to_dict(self) -> dict:
        return {**asdict(self), "percentiles": {f"p{_pct_label(p)}": v for p, v in self.percentiles.items()}}


def _pct_label(p: float) -> str:
    # 99.0 -> "99", 99.9 -> "99.9"
    return f"{p:g}"


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Stats of ``values_s`` (seconds) in ms; percentiles use numpy's default linear interpolation."""
    if len(values_s) == 0:
        return LatencyStats(0, 0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles})
    ms = np.asarray(values_s, dtype=np.float64) * MS_PER_S
    pcts = {float(p): float(np.percentile(ms, p)) for p in percentiles}
    return LatencyStats(len(ms), float(ms.mean()), float(np.median(ms)), float(ms.std()), pcts)


def _slo_value(record: RequestRecord, key: str) -> float:
    """Metric (seconds) compared with SLO ``key``; a missing TPOT counts as 0 (vLLM's rule)."""
    if key == "ttft":
        return record.ttft
    if key == "tpot":
        return tpot(record) or 0.0
    return record.latency


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True iff the (successful) record meets every SLO; SLO values are milliseconds, inclusive."""
    return all(_slo_value(record, key) * MS_PER_S <= limit for key, limit in slos_ms.items())


def _check_slo_keys(slos_ms: dict[str, float]) -> None:
    unknown = set(slos_ms) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown goodput SLO keys {sorted(unknown)}; expected a subset of {SLO_KEYS}")


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Max number of simultaneously open ``[start, start + latency)`` intervals."""
    # At equal timestamps ends (-1) sort before starts (+1), so touching intervals do not overlap.
    events = sorted(ev for r in records for ev in ((r.start, 1), (r.start + r.latency, -1)))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
SPEC_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative-decoding counters accumulated during one run (differences of server counters)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def per_position_acceptance(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate": self.acceptance_rate, "per_position_acceptance": self.per_position_acceptance()}


def spec_decode_delta(before: dict[str, float], after: dict[str, float]) -> SpecDecodeStats | None:
    """Stats from two counter snapshots (``name`` or ``SPEC_PER_POSITION:i`` -> value); None without drafts."""
    diff = {k: after[k] - before.get(k, 0.0) for k in after}
    if diff.get(SPEC_COUNTERS[0], 0) <= 0:
        return None
    positions = sorted(int(k.split(":", 1)[1]) for k in diff if k.startswith(SPEC_PER_POSITION + ":"))
    per_pos = tuple(int(diff[f"{SPEC_PER_POSITION}:{i}"]) for i in positions)
    drafts, tokens, accepted = (int(diff.get(k, 0)) for k in SPEC_COUNTERS)
    return SpecDecodeStats(drafts, tokens, accepted, per_pos)


def cost_per_million_output_tokens(price_per_hour: float | None, duration_s: float, output_tokens: int) -> float | None:
    """Machine cost of the run divided over its output tokens, per 1e6 tokens; None if undefined."""
    if price_per_hour is None or output_tokens <= 0:
        return None
    return price_per_hour * (duration_s / 3600.0) / output_tokens * 1e6


@dataclass
class BenchSummary:
    """Aggregate benchmark result; throughputs are per second of ``duration_s``."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    goodput_slos_ms: dict[str, float] | None
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    peak_concurrency: int
    price_per_hour: float | None
    cost_per_million_output_tokens: float | None
    spec_decode: SpecDecodeStats | None = None

    def to_dict(self) -> dict:
        nested = (LatencyStats, SpecDecodeStats)
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, nested)}
        out.update({k: v.to_dict() for k, v in self.__dict__.items() if isinstance(v, nested)})
        return out

    def format_table(self) -> str:
        """Human-readable multi-line report, one ``label: value`` row per metric."""
        rows = _headline_rows(self)
        for name in ("ttft", "tpot", "itl", "e2el"):
            rows += _stats_rows(name.upper(), getattr(self, f"{name}_ms"))
        width = max(len(label) for label, _ in rows)
        bar = "=" * (width + 16)
        body = [f"{label:<{width}}  {value:>12}" for label, value in rows]
        return "\n".join([bar, " Serving Benchmark Result ".center(len(bar), "="), *body, bar])


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def _headline_rows(s: BenchSummary) -> list[tuple[str, str]]:
    rows = [
        ("Successful requests", _fmt(s.completed)),
        ("Failed requests", _fmt(s.failed)),
        ("Benchmark duration (s)", _fmt(s.duration_s)),
        ("Total input tokens", _fmt(s.total_input_tokens)),
        ("Total generated tokens", _fmt(s.total_output_tokens)),
        ("Request throughput (req/s)", _fmt(s.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(s.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(s.total_token_throughput)),
        ("Peak concurrent requests", _fmt(s.peak_concurrency)),
    ]
    if s.request_goodput is not None:
        rows.append(("Request goodput (req/s)", _fmt(s.request_goodput)))
    if s.price_per_hour is not None:
        rows.append(("Cost per 1M output tokens", _fmt(s.cost_per_million_output_tokens)))
    if s.spec_decode is not None:
        rows += _spec_rows(s.spec_decode)
    return rows


def _spec_rows(spec: SpecDecodeStats) -> list[tuple[str, str]]:
    rows = [("Spec decode mean accepted length", _fmt(spec.mean_accepted_length)),
            ("Spec decode acceptance rate", _fmt(spec.acceptance_rate))]
    return rows + [(f"Spec decode acceptance, position {i}", _fmt(r))
                   for i, r in enumerate(spec.per_position_acceptance())]


def _stats_rows(name: str, st: LatencyStats) -> list[tuple[str, str]]:
    rows = [(f"Mean {name} (ms)", _fmt(st.mean)), (f"Median {name} (ms)", _fmt(st.median))]
    rows.append((f"Std {name} (ms)", _fmt(st.std)))
    return rows + [(f"P{_pct_label(p)} {name} (ms)", _fmt(v)) for p, v in st.percentiles.items()]


def _latency_fields(ok: list[RequestRecord], percentiles: Sequence[float]) -> dict[str, LatencyStats]:
    tpots = [t for t in map(tpot, ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]  # pooled over all gaps of all requests
    return {
        "ttft_ms": latency_stats([r.ttft for r in ok], percentiles),
        "tpot_ms": latency_stats(tpots, percentiles),
        "itl_ms": latency_stats(itls, percentiles),
        "e2el_ms": latency_stats([r.latency for r in ok], percentiles),
    }


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50, 95, 99),
    goodput_slos: dict[str, float] | None = None,
    price_per_hour: float | None = None,
) -> BenchSummary:
    """Aggregate per-request records of one run lasting ``duration_s`` seconds (wall clock)."""
    if not duration_s > 0 or math.isinf(duration_s):
        raise ValueError(f"duration_s must be positive and finite, got {duration_s}")
    ok = [r for r in records if r.success]
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    goodput = None
    if goodput_slos:
        _check_slo_keys(goodput_slos)
        goodput = sum(meets_slos(r, goodput_slos) for r in ok) / duration_s
    return BenchSummary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=n_out / duration_s,
        total_token_throughput=(n_in + n_out) / duration_s,
        request_goodput=goodput,
        goodput_slos_ms=dict(goodput_slos) if goodput_slos else None,
        **_latency_fields(ok, percentiles),
        peak_concurrency=peak_concurrency(records),
        price_per_hour=price_per_hour,
        cost_per_million_output_tokens=cost_per_million_output_tokens(price_per_hour, duration_s, n_out),
    )
