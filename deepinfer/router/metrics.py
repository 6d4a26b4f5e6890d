"""The router's own counters and their Prometheus families, shared by `deepinfer serve --data-parallel-replicas`
and `deepinfer router` (docs/serving.md, "Data-parallel replicas and routing").

Engines are named by their index in the router's list ("0", "1", ...), the same `engine` label the engines' own
series carry under --data-parallel-replicas; `deepinfer router` also exports each index's URL as an info gauge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from deepinfer.router.policy import Decision
from deepinfer.router.state import RouterState

PREFIX = "deepinfer:"
REJECTIONS = ("no_engine", "engine_lost")  # no engine in rotation; the engine was lost while the request ran


@dataclass
class RouterStats:
    decisions: Counter[str] = field(default_factory=Counter)  # routed requests by decision reason
    matched_blocks: Counter[str] = field(default_factory=Counter)  # prompt blocks the chosen engine held, by reason
    prompt_blocks: int = 0  # full prompt blocks of routed requests
    routed: Counter[int] = field(default_factory=Counter)  # routed requests by engine
    retries: int = 0  # requests routed again after their engine was lost before producing anything
    rejections: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(REJECTIONS, 0)))  # answered 503

    def record(self, decision: Decision, num_blocks: int) -> None:
        self.decisions[decision.reason] += 1
        self.matched_blocks[decision.reason] += decision.matched_blocks
        self.prompt_blocks += num_blocks
        self.routed[decision.replica] += 1


class RouterCollector:
    """Router series read at scrape time from its stats and routing state (health, estimated loads)."""

    def __init__(self, stats: RouterStats, state: RouterState, urls: Mapping[int, str] | None = None):
        self.stats, self.state, self.urls = stats, state, urls or {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield _labelled(CounterMetricFamily, "router_requests", "requests routed to an engine, by decision",
                        "decision", s.decisions)
        yield _labelled(CounterMetricFamily, "router_prefix_matched_blocks", "prompt blocks the chosen engine held "
                        "in its prefix cache (as the router knew it), by decision", "decision", s.matched_blocks)
        yield CounterMetricFamily(PREFIX + "router_prompt_blocks", "full prompt blocks of routed requests",
                                  value=s.prompt_blocks)
        yield CounterMetricFamily(PREFIX + "router_retries", "requests routed again after their engine was lost "
                                  "before it produced anything", value=s.retries)
        yield _labelled(CounterMetricFamily, "router_rejections", "requests the router answered with a 503, by "
                        "reason", "reason", s.rejections)
        yield from self._engines()

    def _engines(self) -> Iterator[Metric]:
        engines = sorted(self.state.loads)
        yield _labelled(CounterMetricFamily, "router_engine_requests", "requests routed to the engine", "engine",
                        {str(e): self.stats.routed[e] for e in engines})
        yield _labelled(GaugeMetricFamily, "router_engine_healthy", "1 while the engine is in rotation", "engine",
                        {str(e): int(e in self.state.healthy) for e in engines})
        yield _labelled(GaugeMetricFamily, "router_engine_load_tokens", "the router's estimate of the engine's "
                        "queued + running tokens", "engine", {str(e): self.state.loads[e] for e in engines})
        if self.urls:
            info = GaugeMetricFamily(PREFIX + "router_engine_info", "the engine's URL", labels=["engine", "url"])
            for e in engines:
                info.add_metric([str(e), self.urls[e]], 1)
            yield info


def _labelled(kind, name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    family = kind(PREFIX + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family
