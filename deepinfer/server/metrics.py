"""Prometheus metrics, in a registry of our own (never the process-global one).

Engine-side gauges (running / waiting requests, KV-cache usage and free blocks, preemptions) are read
from the latest EngineStats at scrape time, so a scrape always shows the engine's most recent report. Each of
them carries an `engine` label, one sample per engine replica ("0" when there is one), as vLLM's do.
Request-side counters and histograms are recorded by the API process as outputs reach clients.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "deepinfer:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
EXPERT_LOAD_METRIC = "eplb_expert_load"  # eplb.stats reads scrapes of it
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


class _EngineStatsCollector:
    """Gauges and counters from each engine's latest EngineStats (None before its first report), one sample per
    engine under an `engine` label ("0" for a single engine, the replica id under --data-parallel-replicas), as
    vLLM labels them."""

    def __init__(self, engines: Callable[[], Mapping[str, object]]):
        self._engines = engines

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the engine may not have reported yet at registration

    def collect(self) -> Iterator[Metric]:
        engines = [(name, s) for name, s in self._engines().items()]
        yield from _engine_series(engines)
        yield _accepted_per_position(engines)
        yield from _per_replica(engines)
        yield from _per_rank(engines)
        yield from _eplb(engines)
        yield from _eplb_live(engines)
        yield from _expert_load(engines)


_GAUGES = {"num_requests_running": ("requests running in the engine", "num_running"),
           "num_requests_waiting": ("requests waiting in the engine", "num_waiting"),
           "kv_cache_usage_perc": ("fraction of KV-cache blocks in use (1 = full)", "kv_usage"),
           "kv_cache_free_blocks": ("free KV-cache blocks", "num_free_blocks"),
           "kv_cache_total_blocks": ("KV-cache blocks in the pool", "num_blocks"),
           "kv_transfers_held": ("prefill: prompt caches held for a decode engine", "kv_transfers_held")}
_COUNTERS = {"num_preemptions": ("requests preempted by the scheduler", "num_preemptions"),
             "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", "prefix_queries"),
             "prefix_cache_hits": ("prompt tokens found in the prefix cache", "prefix_hits"),
             # speculative decoding, named like vLLM's so benchmark tools read either engine
             "spec_decode_num_drafts": ("verification rounds with draft tokens", "spec_num_drafts"),
             "spec_decode_num_draft_tokens": ("draft tokens verified", "spec_num_draft_tokens"),
             "spec_decode_num_accepted_tokens": ("draft tokens accepted", "spec_num_accepted_tokens"),
             # prefill/decode disaggregation (docs/disaggregation.md)
             "kv_transfers_sent": ("prefill: prompt caches handed to a decode engine", "kv_transfers_sent"),
             "kv_transfers_released": ("prefill: holds released by the decode engine", "kv_transfers_released"),
             "kv_transfer_leases_expired": ("prefill: holds freed by their lease", "kv_transfer_leases_expired"),
             "kv_transfers_received": ("decode: prompt caches read from a prefill engine", "kv_transfers_received"),
             "kv_transfers_failed": ("decode: transfers that failed or timed out", "kv_transfers_failed"),
             "kv_transfer_bytes": ("decode: bytes read from prefill engines", "kv_transfer_bytes"),
             "kv_transfer_seconds": ("decode: seconds from reservation to arrival, summed", "kv_transfer_seconds"),
             # image inputs (a vision model)
             "images_encoded": ("images run through the vision encoder", "images_encoded"),
             "image_encoder_seconds": ("seconds spent in the vision encoder", "image_encoder_seconds"),
             "image_encoder_cache_hits": ("image spans served from the encoder cache", "image_cache_hits")}


def _engine_series(engines) -> Iterator[Metric]:
    """The scalar series of EngineStats, one sample per engine."""
    for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
        for name, (doc, attr) in table.items():
            family = kind(PREFIX + name, doc, labels=["engine"])
            for engine, s in engines:
                family.add_metric([engine], getattr(s, attr, 0))
            yield family


def _per_replica(engines) -> Iterator[Metric]:
    """Each in-engine DP replica's own scheduler and cache (data_parallel_size > 1)."""
    fields = {"replica_num_requests_running": ("requests running on the DP replica", "num_running"),
              "replica_num_requests_waiting": ("requests waiting on the DP replica", "num_waiting"),
              "replica_kv_cache_usage_perc": ("fraction of the DP replica's KV-cache blocks in use", "kv_usage")}
    for name, (doc, attr) in fields.items():
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["engine", "dp_rank"])
        for engine, s in engines:
            for r in getattr(s, "replicas", None) or []:
                gauge.add_metric([engine, str(r.dp_rank)], getattr(r, attr))
        yield gauge


def _per_rank(engines) -> Iterator[Metric]:
    """Each rank's footprint and expert-parallel traffic (multi-rank engines)."""
    labels = ["engine", "rank", "dp_rank", "tp_rank"]
    gauges = {"rank_weight_bytes": ("bytes of weights the rank holds", "param_bytes"),
              "rank_expert_weight_bytes": ("of which routed experts", "expert_param_bytes"),
              "rank_peak_rss_bytes": ("the rank process's peak resident memory", "peak_rss_bytes")}
    counters = {"rank_moe_payload_bytes": ("bytes expert-parallel collectives delivered to the rank",
                                           "moe_payload_bytes"),
                "rank_steps": ("steps the rank ran", "steps")}
    for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, (doc, attr) in table.items():
            family = kind(PREFIX + name, doc, labels=labels)
            for engine, s in engines:
                for r in getattr(s, "ranks", None) or []:
                    family.add_metric([engine, str(r.rank), str(r.dp_rank), str(r.tp_rank)], getattr(r, attr))
            yield family


def _eplb(engines) -> Iterator[Metric]:
    """Expert-parallel balance over the stats window: mean / max tokens per EP rank, per MoE layer and averaged."""
    engines = [(e, s.eplb_balancedness) for e, s in engines if getattr(s, "eplb_balancedness", None)]
    if not engines:
        return
    layers = GaugeMetricFamily(PREFIX + "eplb_balancedness_per_layer", "mean / max tokens per expert-parallel rank "
                               "of the MoE layer, over the expert-load window", labels=["engine", "layer"])
    mean = GaugeMetricFamily(PREFIX + "eplb_balancedness", "mean over MoE layers of mean / max tokens per "
                             "expert-parallel rank, over the expert-load window", labels=["engine"])
    for engine, per_layer in engines:
        for layer, value in enumerate(per_layer):
            layers.add_metric([engine, str(layer)], value)
        mean.add_metric([engine], sum(per_layer) / len(per_layer))
    yield layers
    yield mean


def _expert_load(engines) -> Iterator[Metric]:
    """The EP load window per (MoE layer, logical expert): what `deepinfer eplb --stats` reads from a scrape."""
    engines = [(e, s.eplb_expert_load) for e, s in engines if getattr(s, "eplb_expert_load", None)]
    if not engines:
        return
    family = GaugeMetricFamily(PREFIX + EXPERT_LOAD_METRIC, "tokens routed to the logical expert of the MoE layer "
                               "over the expert-load window, summed over the ranks",
                               labels=["engine", "layer", "expert"])
    for engine, load in engines:
        for layer, row in enumerate(load):
            for expert, tokens in enumerate(row):
                family.add_metric([engine, str(layer), str(expert)], tokens)
    yield family


def _eplb_live(engines) -> Iterator[Metric]:
    """Live EPLB: rebalances, weights moved and the time it took, balance before / after the last rebalance."""
    engines = [(e, s.eplb) for e, s in engines if getattr(s, "eplb", None) is not None]
    if not engines:
        return
    counters = {"eplb_rebalances": ("EPLB placements computed", "rebalances"),
                "eplb_layers_moved": ("MoE layers whose expert weights EPLB moved", "layers_moved"),
                "eplb_experts_moved": ("expert weight copies EPLB sent between ranks", "experts_moved"),
                "eplb_move_seconds": ("seconds the slowest rank spent moving expert weights", "move_seconds")}
    for name, (doc, attr) in counters.items():
        family = CounterMetricFamily(PREFIX + name, doc, labels=["engine"])
        for engine, eplb in engines:
            family.add_metric([engine], getattr(eplb, attr))
        yield family
    last = GaugeMetricFamily(PREFIX + "eplb_last_rebalance_balancedness", "mean over MoE layers of the "
                             "balancedness at the last rebalance, of the placement before and of the one chosen",
                             labels=["engine", "when"])
    for engine, eplb in engines:
        for when, values in (("before", eplb.balancedness_before), ("after", eplb.balancedness_after)):
            if values:
                last.add_metric([engine, when], sum(values) / len(values))
    yield last


def _accepted_per_position(engines) -> Metric:
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "draft tokens accepted, by position in the draft", labels=["engine", "position"])
    for engine, s in engines:
        for pos, count in enumerate(getattr(s, "spec_accepted_per_pos", None) or []):
            per_pos.add_metric([engine, str(pos)], count)
    return per_pos


class Metrics:
    def __init__(self, engine_stats: Callable[[], Mapping[str, object]], collectors: Sequence[object] = ()):
        """engine_stats: engine label -> its latest EngineStats (or None); collectors: more of the client's own
        (the router's, under --data-parallel-replicas)."""
        disable_created_metrics()  # no `_created` series (process-wide setting; nothing else here uses them)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStatsCollector(engine_stats))
        for collector in collectors:
            self.registry.register(collector)
        self._counters()
        self._histograms()

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

    def _counters(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "prompt tokens of accepted requests")
        self.generation_tokens = self._counter("generation_tokens", "generated tokens sent to clients")
        self.images_received = self._counter("images_received", "images in accepted chat requests (decoded and "
                                             "processed by the API server)")
        self.request_success = self._counter("request_success", "finished choices by finish reason",
                                             ("finished_reason",))

    def _histograms(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "arrival to first token", _LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "time between outputs of a choice, per token",
                                   _LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "arrival to last token", _E2E_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "arrival to first engine output (approximates queueing)", _E2E_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestTimer:
    """Latency bookkeeping of one HTTP request; `last` holds each choice's previous output time."""

    metrics: Metrics
    arrival: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: dict[int, float] = field(default_factory=dict)

    def on_tokens(self, choice: int, num_tokens: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.queue_time.observe(now - self.arrival)
        elif choice in self.last and num_tokens:
            gap = (now - self.last[choice]) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        self.last[choice] = now
        self.metrics.generation_tokens.inc(num_tokens)

    def on_finish(self, reason: str) -> None:
        self.metrics.request_success.labels(finished_reason=reason).inc()

    def on_done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
