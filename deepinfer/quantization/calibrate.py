"""Calibration: the inputs every linear layer and every routed expert of a model sees on calibration text.

`capture(model, run)` hooks the model, calls `run()` (which drives forwards through the engine) and returns
`Activations`. Invariants: hooks are removed even when `run` raises; rows are copied out of the engine's
buffers as float32 on the CPU; each layer keeps at most `max_rows` rows, a seeded uniform sample of all it saw;
an expert's rows are the tokens its MoE's router (the sibling `gate` module) sends to it (any top-k pick),
so per-expert searches see exactly the tokens that expert computes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.distributed.model_parallel import ParallelExperts


@dataclass
class Activations:
    linear: dict[str, torch.Tensor] = field(default_factory=dict)  # module path -> inputs [n, in]
    experts: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # experts path -> per expert [n_e, D]

    def linear_inputs(self, path: str) -> torch.Tensor | None:
        return self.linear.get(path)


def _sample(rows: list[torch.Tensor], max_rows: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.cat(rows) if rows else torch.empty(0)
    if len(x) <= max_rows:
        return x
    return x[torch.randperm(len(x), generator=gen)[:max_rows].sort().values]


def _hooks(model: nn.Module, linear: dict, experts: dict) -> list:
    handles = []
    for path, module in model.named_modules():
        if type(module) is nn.Linear:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, p=path: linear[p].append(args[0].detach().reshape(-1, m.in_features).float().cpu())))
        elif isinstance(module, ParallelExperts):  # its router is the sibling `gate`: x in, (ids, weights) out
            gate = model.get_submodule(path.rpartition(".")[0]).gate
            handles.append(gate.register_forward_hook(
                lambda m, args, out, p=path, n=module.num_experts: _route(n, args[0], out[0], experts[p])))
    return handles


def _route(num_experts: int, x: torch.Tensor, ids: torch.Tensor, out: dict[int, list[torch.Tensor]]) -> None:
    x, ids = x.detach().float().cpu(), ids.detach().cpu()
    for e in range(num_experts):
        picked = (ids == e).any(-1)
        if bool(picked.any()):
            out[e].append(x[picked])


def capture(model: nn.Module, run: Callable[[], None], max_rows: int = 4096, seed: int = 0) -> Activations:
    """The inputs of `model`'s nn.Linear layers and routed experts during `run()` (see the module docstring)."""
    linear: dict[str, list] = defaultdict(list)
    experts: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    handles = _hooks(model, linear, experts)
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    gen = torch.Generator().manual_seed(seed)
    acts = Activations({p: _sample(rows, max_rows, gen) for p, rows in linear.items()})
    for path, per in experts.items():
        module = model.get_submodule(path)
        acts.experts[path] = [_sample(per.get(e, []), max_rows, gen) for e in range(module.num_experts)]
    return acts
