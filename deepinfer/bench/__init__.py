"""Serving benchmark core: workloads (``datasets``) and vLLM-``bench serve``-compatible metrics (``metrics``)."""

from deepinfer.bench.datasets import (
    BenchRequest,
    arrival_times,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from deepinfer.bench.metrics import BenchSummary, LatencyStats, RequestRecord, summarize, tpot

__all__ = [
    "BenchRequest",
    "BenchSummary",
    "LatencyStats",
    "RequestRecord",
    "arrival_times",
    "random_requests",
    "shared_prefix_requests",
    "sharegpt_requests",
    "summarize",
    "tpot",
]
