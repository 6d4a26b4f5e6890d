"""Fast, pure tests of the serving-benchmark metrics and workload generators."""

import json
import math

import numpy as np
import pytest

from deepinfer.bench.datasets import (
    SHAREGPT_MIN_LEN,
    arrival_times,
    length_bounds,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from deepinfer.bench.metrics import RequestRecord, latency_stats, peak_concurrency, summarize, tpot


def rec(ttft=0.1, latency=1.0, out=10, itl=None, start=0.0, prompt=5, success=True):
    return RequestRecord(
        start=start,
        ttft=ttft,
        itl=list(itl or []),
        latency=latency,
        prompt_tokens=prompt,
        output_tokens=out,
        success=success,
        error=None if success else "boom",
    )


def test_tpot_excludes_ttft():
    assert tpot(rec(ttft=0.5, latency=1.5, out=11)) == pytest.approx(0.1)


def test_single_token_has_no_tpot_but_counts_in_throughput():
    records = [rec(ttft=0.5, latency=1.5, out=11), rec(ttft=0.2, latency=0.2, out=1)]
    assert tpot(records[1]) is None
    s = summarize(records, duration_s=2.0)
    assert s.tpot_ms.count == 1 and s.tpot_ms.mean == pytest.approx(100.0)
    assert s.completed == 2 and s.request_throughput == pytest.approx(1.0)
    assert s.total_output_tokens == 12 and s.output_throughput == pytest.approx(6.0)
    assert s.total_token_throughput == pytest.approx((10 + 12) / 2.0)


def test_itl_pooled_over_all_gaps():
    s = summarize([rec(itl=[0.010]), rec(itl=[0.020, 0.030, 0.100])], duration_s=1.0)
    pooled = np.array([10.0, 20.0, 30.0, 100.0])
    assert s.itl_ms.count == 4
    assert s.itl_ms.mean == pytest.approx(pooled.mean())  # 40, not mean of per-request means (30)
    assert s.itl_ms.median == pytest.approx(np.median(pooled))
    assert s.itl_ms.std == pytest.approx(pooled.std())


def test_percentiles_match_numpy():
    values_s = [0.003, 0.001, 0.010, 0.007, 0.002, 0.050, 0.004]
    st = latency_stats(values_s, (50, 90, 95, 99, 99.9))
    for p, v in st.percentiles.items():
        assert v == pytest.approx(np.percentile(np.array(values_s) * 1000, p))
    assert st.to_dict()["percentiles"].keys() == {"p50", "p90", "p95", "p99", "p99.9"}


def test_goodput_requires_every_slo():
    slos = {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    records = [
        rec(ttft=0.1, latency=0.5, out=9),  # tpot 50 ms (inclusive) -> good
        rec(ttft=0.3, latency=0.5, out=9),  # ttft fails
        rec(ttft=0.1, latency=0.9, out=9),  # tpot 100 ms fails
        rec(ttft=0.1, latency=1.2, out=100),  # e2el fails
        rec(ttft=0.1, latency=0.1, out=1),  # no TPOT -> meets tpot SLO vacuously (vLLM: tpot = 0)
    ]
    s = summarize(records, duration_s=2.0, goodput_slos=slos)
    assert s.request_goodput == pytest.approx(2 / 2.0)
    assert summarize(records, duration_s=2.0).request_goodput is None
    with pytest.raises(ValueError):
        summarize(records, duration_s=2.0, goodput_slos={"itl": 1.0})


def test_failed_requests_excluded_from_stats():
    failed = rec(ttft=None, latency=5.0, out=0, success=False, prompt=100)
    s = summarize([rec(ttft=0.1, latency=1.0), failed], duration_s=1.0, goodput_slos={"e2el": 10_000})
    assert (s.completed, s.failed) == (1, 1)
    assert s.ttft_ms.count == 1 and s.e2el_ms.mean == pytest.approx(1000.0)
    assert s.total_input_tokens == 5 and s.request_goodput == pytest.approx(1.0)


def test_cost_per_million_output_tokens():
    s = summarize([rec(out=500), rec(out=1500)], duration_s=1800.0, price_per_hour=4.0)
    assert s.cost_per_million_output_tokens == pytest.approx(4.0 * 0.5 / 2000 * 1e6)  # $1000 per 1M
    assert summarize([rec()], duration_s=1.0).cost_per_million_output_tokens is None


def test_peak_concurrency_from_overlaps():
    records = [
        rec(start=0.0, latency=10.0),
        rec(start=1.0, latency=2.0),
        rec(start=2.5, latency=1.0),
        rec(start=3.0, latency=1.0),
        rec(start=20.0, latency=1.0),
    ]
    assert peak_concurrency(records) == 3  # [0,10), [2.5,3.5), [3,4) around t=3.2
    assert peak_concurrency([rec(start=0.0, latency=1.0), rec(start=1.0, latency=1.0)]) == 1  # touching
    assert summarize(records, duration_s=21.0).peak_concurrency == 3


def test_summary_formats():
    s = summarize([rec(itl=[0.01, 0.02])], duration_s=1.0, goodput_slos={"ttft": 500}, price_per_hour=2.0)
    d = s.to_dict()
    assert d["itl_ms"]["percentiles"]["p99"] == pytest.approx(np.percentile([10.0, 20.0], 99))
    json.dumps(d)
    table = s.format_table()
    assert "P99 TPOT (ms)" in table and "Request goodput" in table and len(table.splitlines()) > 20


@pytest.mark.parametrize("length,ratio", [(100, 0.0), (100, 0.5), (3, 0.9), (1, 0.5)])
def test_random_lengths_within_bounds_and_deterministic(length, ratio):
    reqs = random_requests(500, length, length, range_ratio=ratio, vocab_size=50, seed=7)
    lo, hi = length_bounds(length, ratio)
    assert 1 <= lo and length * (1 - ratio) <= lo <= hi <= max(lo, length * (1 + ratio))
    assert all(lo <= len(p) <= hi and lo <= o <= hi for p, o in reqs)
    assert all(0 <= t < 50 for p, _ in reqs for t in p)
    if hi > lo:  # both ends of the inclusive range are reachable
        assert {len(p) for p, _ in reqs} >= {lo, hi}
    assert reqs == random_requests(500, length, length, range_ratio=ratio, vocab_size=50, seed=7)
    assert reqs != random_requests(500, length, length, range_ratio=ratio, vocab_size=50, seed=8)


def test_shared_prefix_requests():
    reqs = shared_prefix_requests(3, 4, prefix_len=16, suffix_len=8, output_len=5, vocab_size=1000, seed=1)
    assert len(reqs) == 12 and all(len(p) == 24 and o == 5 for p, o in reqs)
    prefixes = [tuple(p[:16]) for p, _ in reqs]
    assert len(set(prefixes[:4])) == 1 and len(set(prefixes[::4])) == 3


def test_sharegpt_requests(tmp_path):
    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    data = [
        conv(("human", "a b c d e"), ("gpt", "w x y z")),
        conv(("human", "too short"), ("gpt", "w x y z v")),  # prompt < SHAREGPT_MIN_LEN
        conv(("gpt", "hi there you all"), ("human", "p q r s"), ("gpt", "1 2 3 4 5 6")),
        conv(("human", "only a human turn here")),
        conv(("human", " ".join(["t"] * 2000)), ("gpt", "w x y z")),  # prompt too long
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    vocab: dict[str, int] = {}

    def encode(text):
        return [vocab.setdefault(w, len(vocab)) for w in text.split()]

    reqs = sharegpt_requests(path, n=10, seed=0, tokenizer_encode=encode)
    assert sorted((len(p), o) for p, o in reqs) == [(4, 6), (5, 4)]
    assert all(len(p) >= SHAREGPT_MIN_LEN for p, _ in reqs)
    assert len(sharegpt_requests(path, n=1, seed=0, tokenizer_encode=encode)) == 1


def test_arrival_mean_gap():
    # Gamma gaps have std = mean / sqrt(shape); with m = n-1 gaps the sample mean's standard error is
    # std / sqrt(m). Allow 4 standard errors (two-sided false-failure rate ~6e-5, and the seed is fixed).
    n, rate = 20000, 5.0
    for shape in (1.0, 0.5, 3.0):
        times = arrival_times(n, rate, burstiness=shape, seed=3)
        gaps = np.diff(times)
        assert times[0] == 0.0 and len(times) == n and (gaps >= 0).all()
        se = (1 / rate) / math.sqrt(shape) / math.sqrt(n - 1)
        assert abs(gaps.mean() - 1 / rate) < 4 * se


def test_arrival_inf_rate_and_determinism():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(100, 2.0, 0.7, seed=1) == arrival_times(100, 2.0, 0.7, seed=1)
    assert arrival_times(0, 2.0) == [] and arrival_times(1, 2.0) == [0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_burstiness_sets_coefficient_of_variation(shape):
    # CV = 1/sqrt(shape). The sample std's relative standard error is ~ sqrt((kurtosis - 1) / 4n); the worst
    # case here (shape 0.25, excess kurtosis 6/shape = 24) gives ~1.8% at n = 20000, so 10% is > 5 SE.
    gaps = np.diff(arrival_times(20000, 10.0, burstiness=shape, seed=11))
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(shape), rel=0.10)
