"""Expert load: tokens routed to each (MoE layer, expert) over a sliding window of steps.

A rank records the routing of the tokens it dispatches itself (its own, real tokens: an idle DP rank's drained
rounds carry none), so the sum over the EP group's ranks is the replica-independent global load. Every rank ends
every step together (ModelParallel.finish_step), so the window's step counter is the same on every rank.
Recording stays on the device (no host sync); `totals` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMAT = "deepinfer-expert-load"
PROMETHEUS_METRIC = "deepinfer:eplb_expert_load"  # server/metrics.py exports it


class ExpertLoad:
    """A ring of `window` step rows [window, layers, experts]; row step % window is the current step's."""

    def __init__(self, num_layers: int, num_experts: int, window: int, device: torch.device | str = "cpu"):
        if window < 1:
            raise ValueError(f"the expert-load window must be >= 1 step, got {window}")
        self.window, self.step = window, 0
        self.ring = torch.zeros(window, num_layers, num_experts, dtype=torch.int32, device=device)

    def record(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count every (token, k) routing of layer `layer` in this step."""
        with torch.inference_mode():  # the ring may be created inside a forward (an inference tensor)
            counts = torch.bincount(expert_ids.flatten().long(), minlength=self.ring.shape[2])
            self.ring[self.step % self.window, layer] += counts.to(self.ring.dtype)

    def end_step(self) -> None:
        """The current step is complete; the oldest step leaves the window."""
        self.step += 1
        with torch.inference_mode():
            self.ring[self.step % self.window].zero_()

    def totals(self) -> torch.Tensor:
        """[layers, experts] tokens routed over the window's steps (the current one included)."""
        return self.ring.sum(dim=0, dtype=torch.long)


def summed_load(rank_stats) -> torch.Tensor | None:
    """[layers, experts] global load: the sum of every rank's own tokens' load (None without EP statistics)."""
    loads = [torch.tensor(s.expert_load, dtype=torch.long) for s in rank_stats if s.expert_load]
    return torch.stack(loads).sum(dim=0) if loads else None


def rank_loads(load: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """[layers, ranks] tokens each EP rank's experts received, for the contiguous placement `starts`."""
    return torch.stack([load[:, a:b].sum(dim=1) for a, b in zip(starts[:-1], starts[1:])], dim=1)


def layer_balancedness(load: torch.Tensor, starts: tuple[int, ...]) -> list[float]:
    """Per MoE layer, mean / max tokens per EP rank (1.0: even; layers without tokens count as even)."""
    per_rank = rank_loads(load, starts).double()
    peak = per_rank.amax(dim=1)
    return torch.where(peak > 0, per_rank.mean(dim=1) / peak.clamp(min=1), 1.0).tolist()


def save_expert_load(path: str | Path, load: torch.Tensor) -> None:
    """The stats `deepinfer eplb --stats` reads: {"format", "version", "expert_load": [layers][experts]}."""
    Path(path).write_text(json.dumps({"format": FORMAT, "version": 1, "expert_load": load.tolist()}))


def load_expert_load(path: str | Path) -> torch.Tensor:
    """[layers, experts] from a save_expert_load file or a saved `/metrics` scrape (its eplb_expert_load)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: not readable ({e})") from e
    if text.lstrip().startswith("{"):
        return _from_json(path, text)
    return _from_prometheus(path, text)


def _from_json(path, text: str) -> torch.Tensor:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a readable expert-load file ({e})") from e
    rows = raw.get("expert_load") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
    if not rows or not all(isinstance(r, list) and len(r) == len(rows[0]) for r in rows):
        raise ValueError(f"{path}: expected {{'format': {FORMAT!r}, 'expert_load': [[tokens per expert] per layer]}}")
    return torch.tensor(rows, dtype=torch.float64)


def _from_prometheus(path, text: str) -> torch.Tensor:
    """The {layer, expert} samples of PROMETHEUS_METRIC in a Prometheus text scrape, as a dense table."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [s for f in text_string_to_metric_families(text) if f.name == PROMETHEUS_METRIC for s in f.samples]
    except ValueError as e:
        raise ValueError(f"{path}: neither an expert-load file nor a Prometheus scrape ({e})") from e
    if not samples:
        raise ValueError(f"{path}: no {PROMETHEUS_METRIC} samples (a scrape of an expert-parallel engine's /metrics)")
    cells: dict[tuple[int, int], float] = {}  # summed over engines (replicas of one model under one traffic)
    for s in samples:
        key = (int(s.labels["layer"]), int(s.labels["expert"]))
        cells[key] = cells.get(key, 0.0) + s.value
    layers, experts = (max(k[i] for k in cells) + 1 for i in (0, 1))
    if len(cells) != layers * experts:
        raise ValueError(f"{path}: {PROMETHEUS_METRIC} misses some (layer, expert) samples")
    load = torch.zeros(layers, experts, dtype=torch.float64)
    for (layer, expert), value in cells.items():
        load[layer, expert] = value
    return load
