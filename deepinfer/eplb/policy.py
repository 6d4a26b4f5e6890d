"""EPLB placement policy: which logical expert each physical expert slot holds, as pure functions.

Same signature and meaning as DeepSeek's public EPLB `rebalance_experts`. Physical slots are laid out GPU-major:
GPU g holds slots [g * per_gpu, (g + 1) * per_gpu), and node n holds GPUs [n * gpus_per_node, ...). Hierarchical
when num_groups % num_nodes == 0 (groups packed onto nodes, replicas packed onto each node's GPUs), otherwise
global (one node of all GPUs). Loads are handled per layer as Python floats (float64); ties break by lowest index,
so the result is a deterministic function of the input.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.eplb.assignment import max_score_assignment

FORMAT, VERSION = "deepinfer-eplb", 1


@dataclass(frozen=True)
class Topology:
    """The placement problem's shape; construction validates it (ValueError naming the problem)."""

    num_logical: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int

    def __post_init__(self) -> None:
        for name in ("num_logical", "num_replicas", "num_groups", "num_nodes", "num_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_replicas % self.num_gpus:
            raise ValueError(f"num_replicas ({self.num_replicas}) must be a multiple of num_gpus ({self.num_gpus})")
        if self.num_replicas < self.num_logical:
            raise ValueError(f"num_replicas ({self.num_replicas}) is fewer than the logical experts "
                             f"({self.num_logical}): every logical expert needs a slot")
        if self.num_gpus % self.num_nodes:
            raise ValueError(f"num_gpus ({self.num_gpus}) must be a multiple of num_nodes ({self.num_nodes})")
        if self.hierarchical and self.num_logical % self.num_groups:
            raise ValueError(f"{self.num_logical} logical experts do not split into {self.num_groups} equal groups")

    @property
    def hierarchical(self) -> bool:
        return self.num_groups % self.num_nodes == 0

    @property
    def nodes(self) -> int:
        """Nodes the layout distinguishes: the global policy treats all GPUs as one node."""
        return self.num_nodes if self.hierarchical else 1

    @property
    def groups(self) -> int:
        return self.num_groups if self.hierarchical else 1

    @property
    def per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.nodes


def _topology(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Topology:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, num_logical_experts], got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight.double()).all() or (weight < 0).any():
        raise ValueError("weight must hold finite, non-negative loads")
    return Topology(weight.shape[1], num_replicas, num_groups, num_nodes, num_gpus)


def _pack(loads: list[float], num_packs: int) -> list[list[int]]:
    """Item ids per pack: heaviest first, each to the lightest pack with room; every pack ends with n / num_packs."""
    cap = len(loads) // num_packs
    if cap == 1:  # every assignment is equally balanced: keep items where they are
        return [[i] for i in range(len(loads))]
    packs, totals = [[] for _ in range(num_packs)], [0.0] * num_packs
    for item in sorted(range(len(loads)), key=lambda i: -loads[i]):  # stable: equal loads by id
        pack = min((p for p in range(num_packs) if len(packs[p]) < cap), key=totals.__getitem__)
        packs[pack].append(item)
        totals[pack] += loads[item]
    return packs


def _replicate(loads: list[float], num_slots: int) -> list[int]:
    """Replica count per expert: one each, then every extra slot to the largest load / count (ties: lowest id)."""
    counts = [1] * len(loads)
    heap = [(-load, e) for e, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-loads[e] / counts[e], e))
    return counts


def _place_node(loads: list[float], experts: list[int], num_slots: int, num_gpus: int) -> list[int]:
    """Logical id of each of a node's slots (GPU-major): replicate its experts into its slots, pack onto its GPUs."""
    counts = _replicate([loads[e] for e in experts], num_slots)
    replicas = [(e, loads[e] / c) for e, c in zip(experts, counts) for _ in range(c)]
    packs = _pack([load for _, load in replicas], num_gpus)
    return [replicas[r][0] for pack in packs for r in pack]


def _place_layer(loads: list[float], topo: Topology) -> list[int]:
    """One layer's phy2log: groups packed onto nodes by group load, then each node placed on its own."""
    size = topo.num_logical // topo.groups
    nodes = _pack([sum(loads[g * size:(g + 1) * size]) for g in range(topo.groups)], topo.nodes)
    slots = topo.num_replicas // topo.nodes
    members = [[g * size + i for g in node for i in range(size)] for node in nodes]
    return [e for experts in members for e in _place_node(loads, experts, slots, topo.gpus_per_node)]


def _log2phy(phy2log: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """[layers, num_logical, max count]: each expert's slots in ascending order, -1 padded."""
    layers, num_logical = logcnt.shape
    order = torch.sort(phy2log, dim=1, stable=True).indices  # slots grouped by expert, ascending within a group
    experts = phy2log.gather(1, order)
    first = torch.cumsum(logcnt, 1) - logcnt  # where each expert's run starts in `order`
    rank = torch.arange(phy2log.shape[1]).expand_as(order) - first.gather(1, experts)
    out = torch.full((layers, num_logical, int(logcnt.max())), -1, dtype=torch.int64)
    out[torch.arange(layers)[:, None], experts, rank] = order
    return out


def _outputs(rows: list[list[int]], num_logical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    phy2log = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)
    logcnt = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    return phy2log, _log2phy(phy2log, logcnt), logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log [layers, num_replicas], log2phy [layers, num_logical, max_replicas], logcnt [layers, num_logical])
    for load statistics `weight` [layers, num_logical]; see the module docstring and docs/eplb.md."""
    topo = _topology(weight, num_replicas, num_groups, num_nodes, num_gpus)
    rows = [_place_layer(loads, topo) for loads in weight.detach().double().cpu().tolist()]
    return _outputs(rows, topo.num_logical)


def _chunks(seq: list, size: int) -> list[list]:
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def _overlap(a: list[int], b: list[int]) -> int:
    """Slots that can keep their expert when contents `a` replace contents `b` (multiset intersection)."""
    return sum((Counter(a) & Counter(b)).values())


def _match_gpus(new: list[list[int]], cur: list[list[int]]) -> tuple[int, list[int]]:
    """(kept slots, current GPU of each new GPU pack) maximising the kept slots among one node's GPUs."""
    score = [[_overlap(a, b) for b in cur] for a in new]
    gpu_of = max_score_assignment(score)
    return sum(score[i][j] for i, j in enumerate(gpu_of)), gpu_of


def _arrange(contents: list[int], current: list[int]) -> list[int]:
    """Order a GPU's new contents so that every slot whose current expert stays on this GPU keeps it."""
    left, out = Counter(contents), list(current)
    for s, e in enumerate(current):
        if left[e]:
            left[e] -= 1
        else:
            out[s] = -1
    rest = iter(left.elements())
    return [e if e >= 0 else next(rest) for e in out]


def _relabel(new: list[int], cur: list[int], topo: Topology) -> list[int]:
    """`new` with node contents, GPU packs and slots permuted to keep the most of `cur`: per-GPU multisets, so
    balancedness and the node/group constraints, are unchanged; the identity is a candidate, so moves never grow."""
    gpn = topo.gpus_per_node
    new_nodes, cur_nodes = (_chunks(_chunks(p, topo.per_gpu), gpn) for p in (new, cur))
    pairs = [[_match_gpus(a, b) for b in cur_nodes] for a in new_nodes]
    node_of = max_score_assignment([[kept for kept, _ in row] for row in pairs])
    gpus: list[list[int]] = [[] for _ in range(topo.num_gpus)]
    for a, b in enumerate(node_of):
        for i, j in enumerate(pairs[a][b][1]):
            gpus[b * gpn + j] = _arrange(new_nodes[a][i], cur_nodes[b][j])
    return [e for gpu in gpus for e in gpu]


def rebalance_experts_migration_aware(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                                      num_gpus: int, current_phy2log: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rebalance_experts`, relabelled to move the fewest expert weights from `current_phy2log`.

    Node contents are assigned to nodes, and each node's GPU packs to its GPUs, by maximum overlap with what
    they hold now (exact assignments); within a GPU, experts stay in the slots that already hold them. The
    balancedness equals the plain policy's and `moved_slots` is never larger than the plain policy's.
    """
    phy2log, _, _ = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    if tuple(current_phy2log.shape) != tuple(phy2log.shape):
        raise ValueError(f"current_phy2log must have shape {tuple(phy2log.shape)}, got {tuple(current_phy2log.shape)}")
    topo = _topology(weight, num_replicas, num_groups, num_nodes, num_gpus)
    rows = [_relabel(n, c, topo) for n, c in zip(phy2log.tolist(), current_phy2log.tolist())]
    return _outputs(rows, topo.num_logical)


def moved_slots(current_phy2log: torch.Tensor, new_phy2log: torch.Tensor) -> int:
    """Physical slots (over all layers) whose logical expert changes: expert weights to copy in."""
    return int((current_phy2log != new_phy2log).sum())


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, logcnt: torch.Tensor) -> torch.Tensor:
    """[layers, num_gpus] tokens per GPU when each logical expert's load is split evenly over its replicas."""
    per_replica = weight.double() / logcnt.double()
    return per_replica.gather(1, phy2log).view(phy2log.shape[0], num_gpus, -1).sum(-1)


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, logcnt: torch.Tensor) -> float:
    """Per layer mean / max of `gpu_loads`, averaged over layers; 1.0 is perfect (a layer without load counts 1)."""
    loads = gpu_loads(weight, phy2log, num_gpus, logcnt)
    peak = loads.max(1).values
    return float(torch.where(peak > 0, loads.mean(1) / peak.clamp_min(1e-300), 1.0).mean())


def placement_balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> list[float]:
    """Per layer mean / max GPU load of `weight` [layers, experts] under `phy2log` (replica counts from it)."""
    logcnt = torch.stack([torch.bincount(row, minlength=weight.shape[1]) for row in phy2log.long()])
    loads = gpu_loads(weight, phy2log.long(), num_gpus, logcnt.clamp_min(1))
    peak = loads.max(1).values
    return torch.where(peak > 0, loads.mean(1) / peak.clamp_min(1e-300), 1.0).tolist()


def validate_placement(phy2log: torch.Tensor, num_gpus: int | None = None, num_logical: int | None = None) -> None:
    """ValueError naming the problem unless phy2log is [layers, slots] of expert ids in which every logical
    expert (0..num_logical - 1, default max id + 1) has >= 1 replica and the slots split evenly over num_gpus."""
    if phy2log.dim() != 2 or phy2log.numel() == 0:
        raise ValueError(f"phy2log must be a non-empty [layers, slots] table, got shape {tuple(phy2log.shape)}")
    if phy2log.min() < 0:
        raise ValueError(f"phy2log holds a negative expert id ({int(phy2log.min())})")
    num_logical = int(phy2log.max()) + 1 if num_logical is None else num_logical
    if phy2log.max() >= num_logical:
        raise ValueError(f"phy2log holds expert id {int(phy2log.max())} but there are {num_logical} experts")
    if num_gpus is not None and phy2log.shape[1] % num_gpus:
        raise ValueError(f"{phy2log.shape[1]} slots per layer do not split evenly over {num_gpus} GPUs")
    for layer, row in enumerate(phy2log.tolist()):
        missing = sorted(set(range(num_logical)) - set(row))
        if missing:
            raise ValueError(f"layer {layer}: logical experts {missing[:8]} have no replica")


def save_placement(path: str | Path, phy2log: torch.Tensor, num_gpus: int | None = None) -> None:
    """Write phy2log as JSON {"format": "deepinfer-eplb", "version": 1, "phy2log": [[...], ...]} after validation."""
    validate_placement(phy2log, num_gpus)
    Path(path).write_text(json.dumps({"format": FORMAT, "version": VERSION, "phy2log": phy2log.tolist()}) + "\n")


def load_placement(path: str | Path, num_gpus: int | None = None, num_logical: int | None = None) -> torch.Tensor:
    """phy2log [layers, slots] (int64) from a file `save_placement` wrote; ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} placement file (\"format\" must be {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported placement version {data.get('version')!r} (expected {VERSION})")
    rows = data.get("phy2log")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and all(type(e) is int for e in r)
                                                        for r in rows):
        raise ValueError(f"{path}: \"phy2log\" must be a non-empty list of lists of integer expert ids")
    if len({len(r) for r in rows}) > 1:
        raise ValueError(f"{path}: layers have different slot counts {sorted({len(r) for r in rows})}")
    phy2log = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)
    validate_placement(phy2log, num_gpus, num_logical)
    return phy2log
